"""Start-up cost of Lily: model load + prepare (fused projections) + kernel warm-up,
cold (empty kernel cache) and warm (second process, same cache), against stock load.

    python benchmarks/startup.py --preset small --out startup.json

Each measurement runs in a fresh process. Prints a table and writes JSON.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import mlx.core as mx
from mlx_lily.synth import build_model
model, _ = build_model(sys.argv[1], seed=0)
mx.eval(model.parameters())
t1 = time.perf_counter()
lily = sys.argv[2] == "lily"
from mlx_lily.patching import warmup
if lily:
    import mlx_lily
    mlx_lily.patch(model)          # prepare (+ kernel warm-up on GPU backends)
warmup(model)                      # first short prefill + decode step
t2 = time.perf_counter()
print(json.dumps({"build_s": t1 - t0, "prepare_and_warmup_s": t2 - t1,
                  "device": str(mx.default_device())}))
"""


def run(preset, arm, cache_dir):
    env = dict(os.environ, MLX_PTX_CACHE_DIR=cache_dir)
    r = subprocess.run([sys.executable, "-c", CHILD, preset, arm], env=env,
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        rows = {"stock": run(a.preset, "stock", d), "lily_cold": run(a.preset, "lily", d),
                "lily_warm": run(a.preset, "lily", d)}
    for k, v in rows.items():
        print(f"{k:10s} build {v['build_s']:7.2f} s   prepare+warm-up {v['prepare_and_warmup_s']:7.2f} s")
    extra = rows["lily_warm"]["prepare_and_warmup_s"] - rows["stock"]["prepare_and_warmup_s"]
    print(f"warm start adds {extra:.2f} s over stock's first forward")
    res = {"preset": a.preset, "rows": rows, "warm_extra_s": extra, "time": time.time()}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
