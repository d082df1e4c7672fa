"""Cold compile time of Lily's CUDA kernel set: ``mlx_lily.cuda_cache.precompile`` with
N worker processes vs one process, each into its own empty cache.

    python benchmarks/gpu/precompile_bench.py --layers 4 --out DIR

The launches come from recording (never evaluating) a prefill, a decode step and a
2048-token prefill through a lazy production-dims model (Qwen3.6-35B-A3B dims, ``--layers``
layers, unfused projections: nothing is materialised). Prints and writes
``DIR/precompile_bench.json``.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    from mlx_lily.bench import gpu_or_explain, write_json

    if not gpu_or_explain("precompile_bench", cuda_only=True):
        return 0
    os.environ.setdefault("MLX_LILY_KERNELS", "all")
    import mlx.core as mx

    import mlx_lily
    from mlx_lily import cuda_cache, synth

    t0 = time.perf_counter()
    model, _ = synth._lazy_model(synth._text_config(num_hidden_layers=a.layers))
    model.eval()
    model.set_dtype(mx.bfloat16)
    mlx_lily.patch()
    _, launches = cuda_cache.record_forward(model)
    res = {"layers": a.layers, "launches": len(launches), "record_s": time.perf_counter() - t0}
    for name, workers in (("parallel", a.workers), ("one_process", 1)):
        with tempfile.TemporaryDirectory() as d:
            r = cuda_cache.precompile(launches, directory=Path(d), workers=workers)
        r["failed"] = {k: v[:300] for k, v in r["failed"].items()}
        res[name] = r
        print(f"{name:12s} workers {r.get('workers')}: {r.get('compiled')}/{r.get('kernels')} "
              f"compiled in {r.get('seconds', 0):.2f} s {r.get('skipped', '')}", flush=True)
    if a.out:
        write_json(a.out, "precompile_bench.json", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
