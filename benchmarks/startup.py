"""Start-up cost of Lily: model load + prepare (fused projections) + kernel warm-up,
cold (empty kernel cache) and warm (second process, same cache), against stock load.

    python benchmarks/startup.py --preset qwen3.6-35b-a3b --layers 4 --out startup.json

Each measurement runs in a fresh process on one fresh kernel cache (stock first, so the
Lily rows pay only for Lily's kernels). ``--layers`` keeps a preset's dims with fewer
layers (the kernel set is the same). Arm ``lily_cold_jit`` is a cold Lily start with the
ahead-of-time compile off (``MLX_LILY_PRECOMPILE=0``: every kernel left to MLX's JIT) on
a copy of the cache as stock left it. Prints a table and writes JSON.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import mlx.core as mx
from mlx_lily.synth import build_model, _text_config, PRESETS
preset = sys.argv[1]
if sys.argv[3] != "0":
    preset = dict(PRESETS[preset], num_hidden_layers=int(sys.argv[3]))
    preset = _text_config(**preset)
model, _ = build_model(preset, seed=0)
mx.eval(model.parameters())
t1 = time.perf_counter()
lily = sys.argv[2] == "lily"
from mlx_lily.patching import warmup
if lily:
    import mlx_lily
    mlx_lily.patch(model)          # prepare (+ kernel warm-up on GPU backends)
else:
    warmup(model)                  # stock: first short prefill + decode step
t2 = time.perf_counter()
from mlx_lily.patching import last_warmup
print(json.dumps({"build_s": t1 - t0, "prepare_and_warmup_s": t2 - t1,
                  "device": str(mx.default_device()), "precompile": dict(last_warmup)}))
"""


def run(preset, arm, cache_dir, layers=0, **env_extra):
    """One fresh process: build the model, then stock warm-up or Lily patch (prepare and
    warm-up); returns its JSON line."""
    env = dict(os.environ, MLX_PTX_CACHE_DIR=cache_dir, **env_extra)
    r = subprocess.run([sys.executable, "-c", CHILD, preset, arm, str(layers)], env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--preset", default="small")
    p.add_argument("--layers", type=int, default=0, help="override the layer count (0: keep)")
    p.add_argument("--no-jit-arm", action="store_true", help="skip the lily_cold_jit arm")
    p.add_argument("--mlx-cache", default=None,
                   help="seed the fresh cache with MLX's own kernels from this cache folder "
                        "(files not named custom_kernel_*), so stock starts warm")
    p.add_argument("--out", default=None)
    p.add_argument("--cpu", action="store_true",
                   help="run on MLX's CPU backend too (there Lily compiles and warms up "
                        "nothing, so the comparison means little)")
    a = p.parse_args()
    from mlx_lily.bench import gpu_or_explain

    if not a.cpu and not gpu_or_explain("startup (--cpu runs it anyway)"):
        return 0
    res = {"preset": a.preset, "layers": a.layers, "rows": {}, "time": time.time()}
    rows = res["rows"]

    def row(name, *args, **env):
        v = rows[name] = run(a.preset, *args, a.layers, **env)
        pc = v.get("precompile") or {}
        extra = (f"   precompile: {pc.get('compiled', 0)} compiled, {pc.get('cached', 0)} cached, "
                 f"{len(pc.get('failed', {}))} failed in {pc.get('seconds', 0):.2f} s"
                 if "kernels" in pc else (f"   precompile: {pc['skipped']}" if "skipped" in pc else ""))
        print(f"{name:14s} build {v['build_s']:7.2f} s   prepare+warm-up "
              f"{v['prepare_and_warmup_s']:7.2f} s{extra}", flush=True)
        if a.out:  # after every row: a run cut short keeps what finished
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)

    with tempfile.TemporaryDirectory() as d, tempfile.TemporaryDirectory() as d2:
        if a.mlx_cache:
            for f in os.listdir(a.mlx_cache):
                if not f.startswith("custom_kernel_"):
                    src = os.path.join(a.mlx_cache, f)
                    (shutil.copytree if os.path.isdir(src) else shutil.copy2)(src, os.path.join(d, f))
        res["mlx_cache_seeded"] = bool(a.mlx_cache)
        row("stock", "stock", d)
        shutil.copytree(d, d2, dirs_exist_ok=True)  # MLX's own kernels, warm, for the JIT arm
        row("lily_cold", "lily", d)
        row("lily_warm", "lily", d)
        if not a.no_jit_arm:
            row("lily_cold_jit", "lily", d2, MLX_LILY_PRECOMPILE="0")
    extra = rows["lily_warm"]["prepare_and_warmup_s"] - rows["stock"]["prepare_and_warmup_s"]
    res["warm_extra_s"] = extra
    print(f"warm start adds {extra:.2f} s over stock's first forward")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)

if __name__ == "__main__":
    main()
