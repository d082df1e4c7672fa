"""Find the Lily kernel launch that faults on a GPU, one child process per case.

A CUDA illegal memory access is sticky: it poisons the process, and every later CUDA
call fails with it, so the failing op cannot be told from the ones after it. This
script runs each case in a child of its own under ``first_contact.probing()`` (every
Lily launch evaluated at once) and prints each launch's ``launch_key`` before it runs,
so the last key a child printed names the launch that faulted.

Cases on a tiny random test model (``tests/_models.build``): ``first_contact`` (the
warm-up check ``mlx_lily.patch`` runs), ``stock-L`` (mlx-lm unpatched, an ``L``-token
prefill and ``--steps`` decode steps), ``lily-L`` (the same patched, first contact
skipped, probed, its prefill logits compared with stock's) for each ``--lengths`` L,
``qmm`` (MLX's own quantized matmul at the test model's shapes). Non-finite outputs are
reported per Lily launch (``NONFINITE``) and, for ``stock-L``, per decoder layer.

    python3 benchmarks/gpu/probe_launches.py --kind qwen3_5_moe --lengths 5,37,130,700 \
        --out probe.json

Writes ``{case: {"rc", "last_launch", "tail", "seconds"}}`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


#: Kernels whose index inputs are checked before launch (an index out of range is the
#: usual cause of an illegal address): name -> [(input position, what it indexes)].
INSPECT = {"moeg_combine": [(1, "pair_pos -> y_pairs rows", 0)],
           "moeg_gate_up": [(1, "sorted_pairs -> pairs", None), (2, "tiles", None)],
           "moeg_down": [(1, "tiles", None)],
           "moeg_route_rank": [(0, "expert ids", None)]}


def _inspect(name: str, kw: dict) -> None:
    import mlx.core as mx
    import numpy as np

    ins = kw["inputs"]
    mx.eval(ins)
    mx.synchronize()
    for pos, what, target in INSPECT[name]:
        a = np.array(ins[pos])
        info = f"{what}: shape {a.shape} min {a.min()} max {a.max()}"
        if target is not None:
            rows = ins[target].shape[0]
            info += f" (rows {rows}; permutation {sorted(a.tolist()) == list(range(rows))})"
        if what == "tiles":
            used = a[a[:, 2] > 0]
            end = (used[:, 1] + used[:, 2]).max() if len(used) else None
            info += f" used {len(used)} max start+cnt {end}"
        print("INSPECT", name, info, file=sys.stderr, flush=True)


def _nonfinite(a) -> int:
    """Non-finite elements of the array ``a`` (evaluates it)."""
    import mlx.core as mx

    return int((~mx.isfinite(a)).sum().item())


def _bad_counts(arrays) -> list:
    """Non-finite element counts of the floating arrays of more than one element (None
    for the others: integers and one-element placeholders)."""
    import mlx.core as mx

    res = []
    for a in arrays:
        if not isinstance(a, mx.array) or a.size < 2 or a.dtype not in (
                mx.float32, mx.float16, mx.bfloat16):
            res.append(None)
            continue
        res.append(_nonfinite(a))
    return res


def _report_nonfinite(gk, kw: dict, outs) -> None:
    """Print ``NONFINITE`` with the launch's non-finite counts per input and output when
    an output has any (``launches`` after the first such line name its consequences)."""
    bad_out = _bad_counts(outs)
    if not any(bad_out):
        return
    bad_in = _bad_counts(kw.get("inputs", ()))
    print("NONFINITE", gk.op, gk.spec.name, "inputs", bad_in, "outputs", bad_out,
          "of", [tuple(o.shape) for o in outs], file=sys.stderr, flush=True)


def _watch_layers(model) -> None:
    """Print ``LAYER i nonfinite n of size`` after each decoder layer of an unpatched
    model (its layers list replaced by wrappers that evaluate their output)."""
    inner = model.language_model.model if hasattr(model, "language_model") else model.model

    class Watch:
        def __init__(self, i, layer):
            self.i, self.layer = i, layer

        def __getattr__(self, name):
            return getattr(self.layer, name)

        def __call__(self, *args, **kw):
            y = self.layer(*args, **kw)
            print("LAYER", self.i, "nonfinite", _nonfinite(y), "of",
                  y.size, file=sys.stderr, flush=True)
            return y

    inner.layers = [Watch(i, layer) for i, layer in enumerate(inner.layers)]


def _qmm_check() -> None:
    """``mx.quantized_matmul`` (4-bit, group 64) against a matmul of the dequantized
    weights at the test model's projection shapes and row counts 1..130: prints
    ``QMM M K N nonfinite max_rel_err`` per shape."""
    import mlx.core as mx

    for K, N in ((128, 64), (64, 128), (128, 1024), (512, 128), (128, 512)):
        w = (mx.random.normal((N, K)) * K ** -0.5).astype(mx.bfloat16)
        wq, sc, bi = mx.quantize(w, 64, 4)
        wd = mx.dequantize(wq, sc, bi, 64, 4)
        for M in (1, 5, 8, 9, 16, 20, 31, 32, 33, 37, 48, 64, 65, 130):
            x = mx.random.normal((M, K)).astype(mx.bfloat16)
            y = mx.quantized_matmul(x, wq, sc, bi, True, 64, 4)
            ref = x.astype(mx.float32) @ wd.astype(mx.float32).T
            bad = _nonfinite(y)
            err = float((mx.abs(y.astype(mx.float32) - ref).max()
                         / (mx.abs(ref).max() + 1e-6)).item())
            print("QMM", M, K, N, "nonfinite", bad, "max_rel_err", round(err, 4), flush=True)


def _child(case: str, kind: str, steps: int, overrides: dict) -> None:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    import _models
    import mlx_lily
    from mlx_lily import first_contact

    if mx.is_available(mx.gpu):
        mx.set_default_device(mx.gpu)
    model = _models.build(kind, **overrides)
    orig = first_contact.launch

    def traced(gk, kw):
        print("LAUNCH", gk.op, first_contact.launch_key(gk, kw), file=sys.stderr, flush=True)
        if gk.spec.name in INSPECT:
            _inspect(gk.spec.name, kw)
        out = orig(gk, kw)
        print("DONE", gk.spec.name, file=sys.stderr, flush=True)
        _report_nonfinite(gk, kw, out)
        return out

    first_contact.launch = traced
    if case == "qmm":
        _qmm_check()
        return
    if case == "first_contact":
        from mlx_lily import kernels

        with mlx_lily.patched(model, force=True):  # its warm-up runs first contact
            print("REPORT", json.dumps({"off": kernels.runtime_disabled()}), flush=True)
        return
    case = case.split("@")[0]
    arm, n = case.rsplit("-", 1)
    prompt = [(i * 37) % 500 + 1 for i in range(int(n))]

    def run():
        cache = make_prompt_cache(model)
        logits = model(mx.array([prompt]), cache=cache)
        mx.eval(logits)
        print("PREFILL OK", flush=True)
        tok = int(mx.argmax(logits[0, -1]).item())
        for _ in range(steps):
            logits = model(mx.array([[tok]]), cache=cache)
            mx.eval(logits)
            tok = int(mx.argmax(logits[0, -1]).item())
        mx.synchronize()
        print("DECODE OK", tok, flush=True)

    if arm == "stock":
        _watch_layers(model)
        run()
        return
    stock = model(mx.array([prompt]), cache=make_prompt_cache(model))
    mx.eval(stock)
    model._lily_warm = True  # skip first contact: probe this case's launches directly
    with mlx_lily.patched(model, force=True), first_contact.probing():
        lily = model(mx.array([prompt]), cache=make_prompt_cache(model))
        mx.eval(lily)
        diff = mx.abs(lily.astype(mx.float32) - stock.astype(mx.float32))
        print("PREFILL VS STOCK", json.dumps({
            "stock_nonfinite": _nonfinite(stock),
            "lily_nonfinite": _nonfinite(lily),
            "max_abs_diff": float(mx.max(diff).item()),
            "top1_agree": float(mx.mean(mx.argmax(lily, -1) == mx.argmax(stock, -1)).item())}),
            flush=True)
        run()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", default="qwen3_5_moe")
    ap.add_argument("--lengths", default="5,37,130,700")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--timeout-s", type=float, default=240)
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", default=None,
                    help="comma list of cases instead: first_contact, stock-L, lily-L, "
                         "each with optional @VAR=VALUE environment settings joined by @")
    ap.add_argument("--override", action="append", default=[], metavar="KEY=INT",
                    help="test-model config entry (e.g. moe_intermediate_size=64)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        _child(a.child, a.kind, a.steps,
               {k: int(v) for k, v in (o.split("=", 1) for o in a.override)})
        return
    lengths = [int(x) for x in a.lengths.split(",") if x]
    cases = ["first_contact"] + [f"{arm}-{n}" for n in lengths for arm in ("stock", "lily")]
    if a.cases:
        cases = a.cases.split(",")
    res = {}
    for case in cases:
        t0 = time.perf_counter()
        env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
        env.update(kv.split("=", 1) for kv in case.split("@")[1:])
        try:
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", case,
                                "--kind", a.kind, "--steps", str(a.steps)]
                               + [f"--override={o}" for o in a.override],
                               capture_output=True, text=True, timeout=a.timeout_s, env=env)
            rc, out, err = p.returncode, p.stdout, p.stderr
        except subprocess.TimeoutExpired as e:
            rc, out, err = "timeout", e.stdout or "", e.stderr or ""
            out, err = [s.decode() if isinstance(s, bytes) else s for s in (out, err)]
        launches = [ln for ln in err.splitlines() if ln.startswith("LAUNCH")]
        inspected = [ln for ln in err.splitlines() if ln.startswith("INSPECT")]
        nonfinite = [ln for ln in err.splitlines() if ln.startswith(("NONFINITE", "LAYER"))
                     and "nonfinite 0 of" not in ln]
        done = [ln for ln in err.splitlines() if ln.startswith("DONE")]
        res[case] = {"rc": rc, "launches": len(launches), "completed": len(done),
                     "last_launch": launches[-1] if launches else None,
                     "inspected": inspected[-12:],
                     "nonfinite": nonfinite[:12],
                     "stdout": out[-8000:],
                     "tail": "\n".join(ln for ln in err.splitlines()
                                       if not ln.startswith(("LAUNCH", "DONE", "INSPECT", "NONFINITE", "LAYER")))[-3000:],
                     "seconds": round(time.perf_counter() - t0, 1)}
        ok = rc == 0
        print(f"{case}: rc {rc}, {len(launches)} launches, {res[case]['seconds']} s"
              + "".join(f"\n  {ln}" for ln in inspected[-6:] + nonfinite[:4])
              + ("" if ok else f"\n  last: {res[case]['last_launch']}\n  "
                 + res[case]["tail"][-800:].replace("\n", "\n  ")), flush=True)
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
