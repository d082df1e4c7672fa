#!/usr/bin/env python
"""An injected kernel failure on a real GPU: only the failing op is turned off and the
answers equal those with that op's kernels off from the start.

    python benchmarks/first_contact_fault.py [--synthetic PRESET] [--layers N] \
        [--op attention] [--kind build|threadgroup|launch|wrong|nonfinite]

Run B (baseline): the default kernel set minus ``--op`` (``kernels.only_ops``), patched,
warm-up (first contact) included, then the logits of ``first_contact.forward_logits``.
Run A: the default set, ``MLX_LILY_INJECT_FAULT=<op>:<kind>``; the warm-up must turn
exactly ``--op`` off with one warning, and A's logits must equal B's (max |A - B| is
printed; kernels with atomics may reorder sums, hence ``--tol``). Exit 0 when both hold.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--synthetic", default="qwen3.6-35b-a3b")
    p.add_argument("--layers", type=int, default=-1)
    p.add_argument("--op", default="attention")
    p.add_argument("--kind", default="build")
    p.add_argument("--tol", type=float, default=0.0)
    opts = p.parse_args(argv)

    import mlx.core as mx

    import mlx_lily
    from mlx_lily import backend, first_contact, kernels, patching, qualify

    model, desc = qualify.load_model(synthetic=opts.synthetic, layers=opts.layers)
    be = backend.current_backend()
    default = [op for op in first_contact.active_ops(be)]
    print(f"{desc}; backend {be}; default kernel ops {default}", flush=True)
    if opts.op not in default:
        print(f"--op {opts.op} runs no kernel by default here", file=sys.stderr)
        return 2
    rest = [op for op in default if op != opts.op]

    with kernels.only_ops(rest):
        with mlx_lily.patched(model):
            want = first_contact.forward_logits(model, 8, 64)
    model.__dict__.pop("_lily_warm", None)
    kernels.clear_runtime_disabled()

    os.environ[first_contact.INJECT_ENV] = f"{opts.op}:{opts.kind}"
    kernels._CACHE.clear()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with mlx_lily.patched(model):
            rep = patching.last_warmup.get("first_contact", {})
            got = first_contact.forward_logits(model, 8, 64)
            info = mlx_lily.backend_info()
    off = [str(x.message) for x in w if "turned off" in str(x.message)]
    diff = float(mx.abs(got - want).max().item())
    print(f"first contact: {rep.get('seconds', 0):.2f} s, failed {rep.get('failed')}")
    print(f"warnings: {off}")
    print(f"runtime_disabled: {info['runtime_disabled']}")
    print(f"max |logits(A) - logits(B)| = {diff:.3e}")
    ok = (set(info["runtime_disabled"]) == {opts.op} and len(off) == 1
          and diff <= opts.tol)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
