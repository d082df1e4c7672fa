"""Host cost per custom-kernel launch on MLX's CUDA backend, with and without large input
arrays: does MLX's graph-commit rule make a decode step's many expert-weight inputs
expensive?

MLX 0.32's CUDA command encoder (``backend/cuda/device.cpp``, read, not copied) adds each
input's whole ``data_size`` (in elements, not bytes: ``array.h``) to a count for the graph
being built and commits the graph (update + launch) once it exceeds
``MLX_MAX_MB_PER_BUFFER`` Mi (1000 on sm_90), besides every ``MLX_MAX_OPS_PER_BUFFER``
(100) nodes; ``eval`` blocks while more than 10 such commits are in flight
(``MAX_ACTIVE_TASKS``, ``transforms.cpp``). Lily's expert kernels take all experts' weights
(~117 M elements per MoE layer), so a decode step adds a commit every ~9 layers (with CUDA
graphs on, MLX's default: with ``MLX_USE_CUDA_GRAPHS=0`` input sizes are not counted). This
script times chains of a trivial kernel (copy 1024 floats) that also takes no extra inputs,
``--inputs`` or ``--many-inputs`` 16-byte arrays, or ``--inputs`` arrays of ``--big-mb``
MiB (never read), or a ``--source-kb`` KiB source (the same kernel after a comment: MLX
hashes each launch's whole generated source to find its module), or that comment in a file
the header ``#include``s (Lily's default form, ``MLX_LILY_CUDA_SOURCE``), one process, alternating
variants (how the host cost grows with a launch's input count, its inputs' size and its
source's length):
host seconds to dispatch the chain (``mx.async_eval``) and wall seconds to finish it, per
launch, medians. Prints a table; writes ``dispatch_bench.json`` to ``--out``.

    python benchmarks/gpu/dispatch_bench.py --out DIR   # on MLX's CUDA backend
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import mlx.core as mx

_SRC = """
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < N) y[i] = x[i] + 1.0f;
"""


def _kernel(n_extra: int, source_kb: int = 0, include_dir: str | None = None):
    """The probe kernel with ``n_extra`` unused inputs and ``source_kb`` KiB of comment in
    its header: inline, or (``include_dir``) in a file there that the header ``#include``s
    (how ``mlx_lily.kernels.cuda_include_parts`` hands MLX Lily's kernels)."""
    names = ["x"] + [f"w{i}" for i in range(n_extra)]
    pad = ("// " + "x" * 60 + "\n") * (source_kb * 1024 // 64)
    name = f"lily_dispatch_probe{n_extra}_{source_kb}"
    if include_dir is not None:
        path = os.path.join(include_dir, f"{name}.cuh")
        with open(path, "w") as f:
            f.write(pad)
        pad, name = f'#include "{os.path.abspath(path)}"\n', name + "_inc"
    return mx.fast.cuda_kernel(name=name, input_names=names, output_names=["y"],
                               source=_SRC, header=pad)


def _chain(kern, x, extras, length: int):
    for _ in range(length):
        (x,) = kern(inputs=[x, *extras], template=[("N", x.size)], grid=(x.size, 1, 1),
                    threadgroup=(256, 1, 1), output_shapes=[x.shape],
                    output_dtypes=[x.dtype])
    return x


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--length", type=int, default=300, help="launches per chain")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--inputs", type=int, default=4, help="extra input arrays per launch")
    ap.add_argument("--many-inputs", type=int, default=16,
                    help="extra small inputs per launch in the many-inputs variant")
    ap.add_argument("--big-mb", type=int, default=128, help="MiB of each large input")
    ap.add_argument("--source-kb", type=int, default=20,
                    help="KiB of comment in the long-source variant's header")
    a = ap.parse_args(argv)
    if a.inputs == a.many_inputs:
        ap.error("--inputs and --many-inputs must differ (one variant each)")
    from mlx_lily.backend import current_backend

    if current_backend() != "cuda":
        print("dispatch_bench: needs MLX's CUDA backend; nothing measured")
        return 0
    x0 = mx.zeros((1024,), mx.float32)
    small = [mx.zeros((4,), mx.float32) + i for i in range(max(a.inputs, a.many_inputs))]
    big = [mx.zeros((a.big_mb << 18,), mx.float32) + i for i in range(a.inputs)]
    mx.eval(x0, small, big)
    # name -> (kernel, extra inputs): input count and input size varied one at a time
    variants = {"no extra inputs": (_kernel(0), []),
                f"{a.inputs} small inputs (16 B)": (_kernel(a.inputs), small[:a.inputs]),
                f"{a.many_inputs} small inputs (16 B)": (_kernel(a.many_inputs),
                                                          small[:a.many_inputs]),
                f"{a.inputs} large inputs ({a.big_mb} MiB)": (_kernel(a.inputs), big),
                f"{a.source_kb} KiB source": (_kernel(0, a.source_kb), []),
                f"{a.source_kb} KiB source as #include": (
                    _kernel(0, a.source_kb, tempfile.mkdtemp(prefix="lily-dispatch-")), [])}
    res = {name: {"dispatch_s": [], "wall_s": []} for name in variants}
    for rep in range(a.reps + 1):  # the first round warms up (compiles)
        for name, (kern, extras) in variants.items():
            mx.synchronize()
            t0 = time.perf_counter()
            y = _chain(kern, x0, extras, a.length)
            mx.async_eval(y)
            t1 = time.perf_counter()
            mx.eval(y)
            mx.synchronize()
            t2 = time.perf_counter()
            if rep:
                res[name]["dispatch_s"].append(t1 - t0)
                res[name]["wall_s"].append(t2 - t0)
            assert abs(y[0].item() - a.length) < 1e-3
    out = {"device": str(mx.default_device()), "mlx": mx.__version__, "length": a.length,
           "reps": a.reps, "inputs": a.inputs, "many_inputs": a.many_inputs,
           "big_mb": a.big_mb,
           "env": {k: os.environ.get(k) for k in ("MLX_MAX_MB_PER_BUFFER",
                                                  "MLX_MAX_OPS_PER_BUFFER",
                                                  "MLX_USE_CUDA_GRAPHS")},
           "source_kb": a.source_kb,
           "variants": {}}
    print(f"{a.length} launches per chain, medians of {a.reps}")
    for name, r in res.items():
        d = statistics.median(r["dispatch_s"]) / a.length * 1e6
        w = statistics.median(r["wall_s"]) / a.length * 1e6
        out["variants"][name] = {"dispatch_us_per_launch": d, "wall_us_per_launch": w,
                                 **r}
        print(f"  {name:30s} dispatch {d:7.2f} us/launch, wall {w:7.2f} us/launch")
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "dispatch_bench.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
