#!/usr/bin/env python
"""Teacher-forced numerics at long context: Lily vs stock, each vs an fp32 evaluation, with routing agreement.

For each context length L (``--contexts``, default 4096 and 32768) the reference ids (the
checkpoint's ``numerics_reference.json``, written by ``benchmarks/train_production_width.py``)
are fed through a fresh mlx-lm cache by every engine:

1. ``ids[:L - P]`` prefilled in chunks of ``--prefill-step`` (logits dropped);
2. the measured prefill chunk ``ids[L - P:L]`` (``P = --measure-prefill``), one forward;
3. ``--decode-steps`` D one-token steps on ``ids[L:L + D]`` (teacher-forced).

The P + D measured rows (each predicting the next reference id) are compared. Engines:
``fp32`` (stock code, every float parameter in fp32, the quantised weights unchanged),
``stock`` (mlx-lm as loaded) and, for each ``--kernels`` mode (``default`` = Lily's
verified set, or the backend's shipped set by name on a device with no record;
``all`` = ``MLX_LILY_KERNELS=all``; ``each`` = one mode per op of the default set with
the ops it requires, ``each_op_modes``),
``lily-<mode>`` twice: once as users run it (compiled decode steps on GPU backends) for
the logits, and once with the same decode-step
functions built by an identity ``mx.compile`` (``decode_steps_eager``; compiled functions run
no Python) to capture the routing; the two runs' logits are compared too
(``eager_vs_compiled``). A mode where Lily stands aside (its numerics would be stock's) is
skipped and recorded under ``skipped_modes`` with the reason; the other modes still run,
and the run exits 1.

Metrics per pair (reference -> engine) and section (``prefill``, ``decode``, ``all``):
perplexity of each, relative perplexity difference, top-1 agreement, mean/max KL(reference ||
engine), and routing agreement per MoE layer: the fraction of (token, expert) choices of the
engine's top-k that are also in the reference's.

Routing is captured without changing the model: stock engines through mlx-lm's
``SwitchGLU.__call__`` (its ``indices`` argument), Lily through wrappers of the functions
that produce expert ids (``patches.blocks.moe_router_topk`` / ``moe_router_topk_pending`` /
``_stock_routing``; the routed decode kernels' plans in ``mlx_lily.ops.moe_experts``:
``decode_plan(topk=True)`` returns the ids, ``fused_plan``'s scratch output holds them at the
offset ``lily_moe_decode`` writes them). Targets (issue 29, reported, not enforced): Lily vs
stock ppl within 0.1%, top-1 >= 98%, routing >= 99%; Lily no further from fp32 than stock.

Usage::

    python benchmarks/numerics_long.py ~/.cache/mlx-lily/models/qwen35moe-production-width \\
        --out /tmp/numerics_long.json
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import os
import sys
import time
from pathlib import Path

try:  # an installed mlx-lily (its mlx_lily.patches is mapped from ./patches at install)
    import mlx_lily.patches  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout: stock arms

from mlx_lily.bench.authority import THRESHOLDS  # noqa: E402
from mlx_lily.bench.authority import compare_logits as compare  # noqa: E402
from mlx_lily.bench.authority import teacher_forced_logits  # noqa: E402
from mlx_lily.bench.authority import routing_agreement  # noqa: E402,F401 (tests use it)

SCHEMA = "mlx-lily-numerics-long"
TARGETS = {**THRESHOLDS, "routing_agreement_min": 0.99}
KERNEL_MODES = {"default": "verified", "all": "all"}


def kernels_for_mode(mode: str, log=print) -> str:
    """The ``kernels`` setting of a ``--kernels`` mode. ``default``: ``verified`` where this
    device has a say (a valid qualification record, even one that qualified nothing, or
    a shipped record matching it), else the shipped set of this backend by name (a GPU
    with no record would otherwise wait for a qualification, and until then Lily stands
    aside and "Lily" would be stock)."""
    if mode != "default":
        return KERNEL_MODES.get(mode, mode.replace("+", ","))
    from mlx_lily import backend, kernels, qualify

    be = backend.current_backend()
    if be == "cpu" or qualify.record_ops(be) is not None or kernels.shipped_matches(be):
        return "verified"
    shipped = sorted(kernels.VERIFIED.get(be, ()))
    if not shipped:
        return "verified"
    log(f"--kernels default: no record or shipped record for this {be} device; using the "
        f"shipped {be} set by name ({len(shipped)} ops)")
    return ",".join(shipped)


def each_op_modes(default_kernels: str, backend_name: str) -> list:
    """``--kernels each``: one mode per op of the default set (``default_kernels``, the
    ``kernels`` setting ``kernels_for_mode("default")`` gave: ``verified`` or a comma list)
    on ``backend_name``: the op with the ops it requires (``registry``), joined by '+' in
    ``OP_NAMES`` order. Every other op runs its reference, so each mode's error against
    stock and fp32 is that op's own (with its requirements'). Empty when the default set
    has no op."""
    from mlx_lily import backend, first_contact, kernels

    ops = (set(kernels.verified_ops(backend_name)) if default_kernels == "verified"
           else {o for o in default_kernels.split(",") if o})

    def closure(op, seen):
        for q in first_contact.requires(op):
            if q in backend.OP_NAMES and q not in seen:
                seen.add(q)
                closure(q, seen)
        return seen

    out = []
    for op in backend.OP_NAMES:
        if op in ops:
            mode = "+".join(o for o in backend.OP_NAMES if o in closure(op, {op}))
            if mode not in out:
                out.append(mode)
    return out


def why_not_serving(mode: str) -> str | None:
    """None when Lily's forwards are installed now, else why ``mode`` cannot be measured
    (a Lily that stepped aside runs mlx-lm's own code: its numerics would be stock's)."""
    import mlx_lily

    info = mlx_lily.backend_info()
    if info["patch"] != "patched":
        return (f"numerics_long: --kernels {mode}: Lily is {info['patch']} here "
                f"({info.get('stepped_aside')}); nothing of Lily's would be measured")
    return None


# --------------------------------------------------------------------------
# routing capture
# --------------------------------------------------------------------------
class RoutingRecorder:
    """Collects expert ids ``[rows, k]`` in call order while ``on``; one list per forward."""

    def __init__(self):
        self.on = False
        self.calls: list = []  # (source, array) of the current forward
        self.seen: set = set()  # ids of the arrays recorded in this forward

    @contextlib.contextmanager
    def forward(self):
        """Record the routing of one model call; yields the list that receives it."""
        self.calls, self.seen, self.on = [], set(), True
        try:
            yield self.calls
        finally:
            self.on = False

    def add(self, source: str, inds) -> None:
        if self.on and id(inds) not in self.seen:
            self.seen.add(id(inds))
            self.calls.append((source, inds))


REC = RoutingRecorder()
_INSTALLED: list = []


def install_capture() -> None:
    """Wrap the routing producers (module globals, class methods); idempotent. Each
    wrapper returns exactly what it wraps; it records only inside ``REC.forward()``."""
    if _INSTALLED:
        return
    import mlx.core as mx
    from mlx_lm.models import switch_layers

    orig_glu = switch_layers.SwitchGLU.__call__

    def glu_call(self, x, indices):
        REC.add("SwitchGLU", indices)
        return orig_glu(self, x, indices)

    switch_layers.SwitchGLU.__call__ = glu_call
    _INSTALLED.append((switch_layers.SwitchGLU, "__call__", orig_glu))
    try:
        from mlx_lily.ops import moe_experts as me
        from mlx_lily.patches import blocks
    except ImportError:  # no Lily: stock engines only
        return

    def wrap_router(name, pos):
        orig = getattr(blocks, name)

        def f(*a, **kw):
            out = orig(*a, **kw)
            REC.add(name, out[pos])
            return out

        setattr(blocks, name, f)
        _INSTALLED.append((blocks, name, orig))

    wrap_router("moe_router_topk", 0)
    wrap_router("moe_router_topk_pending", 0)
    wrap_router("_stock_routing", 0)

    orig_decode_plan = me.decode_plan

    def decode_plan(*a, **kw):
        run = orig_decode_plan(*a, **kw)
        if not kw.get("topk") or run is None:
            return run

        def routed(*ra):
            out = run(*ra)
            REC.add("moe_experts_routed", out[1])
            return out

        return routed

    me.decode_plan = decode_plan
    _INSTALLED.append((me, "decode_plan", orig_decode_plan))

    orig_fused_plan = me.fused_plan

    def fused_plan(kernel, wts, router, x_shape, x_dtype, k, norm_topk_prob, offset, **kw):
        d, i, e, sz = wts.hidden, wts.inter, wts.num_experts, x_dtype.size
        r16 = lambda b: -(-b // 16) * 16  # noqa: E731  (lily_moe_decode's section offsets)
        o_in = (r16((k + 1) * i * sz) + r16(d * sz) + r16((e + 1) * sz) + r16(k * sz) + 16) // 4
        wpr = me.fused_work_words(d, i, k, e, sz)
        lead = tuple(x_shape[:-1])
        if (o_in + r16(k * 4) // 4) != wpr:  # the ids close each row's scratch
            print(f"numerics_long: moe_fused scratch layout changed (ids at word {o_in}, "
                  f"row of {wpr} words): its routing is not captured", file=sys.stderr)
            return orig_fused_plan(kernel, wts, router, x_shape, x_dtype, k, norm_topk_prob,
                                   offset, **kw)

        def recording_kernel(*ka, **kkw):
            out = kernel(*ka, **kkw)
            if REC.on:
                ids = out[2].reshape(-1, wpr)[:, o_in:o_in + k].reshape(lead + (k,))
                REC.add("moe_fused", ids)
            return out

        return orig_fused_plan(recording_kernel, wts, router, x_shape, x_dtype, k,
                               norm_topk_prob, offset, **kw)

    me.fused_plan = fused_plan
    _INSTALLED.append((me, "fused_plan", orig_fused_plan))
    del mx


def uninstall_capture() -> None:
    """Undo ``install_capture``."""
    while _INSTALLED:
        owner, name, orig = _INSTALLED.pop()
        setattr(owner, name, orig)


def routing_rows(calls, n_layers: int):
    """``[n_layers]`` numpy ``[rows, k]`` from one forward's calls, or None when the count
    is not one per MoE layer (then the forward is not attributed)."""
    import mlx.core as mx
    import numpy as np

    if len(calls) != n_layers:
        return None
    out = []
    for _, a in calls:
        a = a.astype(mx.int32) if a.dtype != mx.int32 else a
        mx.eval(a)
        arr = np.array(a)
        out.append(arr.reshape(-1, arr.shape[-1]))
    return out


# --------------------------------------------------------------------------
# engines
# --------------------------------------------------------------------------
def run_engine(model, ids, L: int, P: int, D: int, step: int, *, capture: bool, n_moe: int,
               label: str, log):
    """Feed ``ids[:L + D]`` as the module doc says (``authority.teacher_forced_logits``,
    each measured forward through the routing capture when ``capture``); returns
    ``(logits [P + D, V] float32 numpy, routing per layer [P + D, k] or None, seconds per
    phase)``."""
    import mlx.core as mx
    import numpy as np

    routes, ok = [[] for _ in range(n_moe)], capture
    sources: set = set()

    def one(xs, cache):
        nonlocal ok
        if not capture:
            return model(xs, cache=cache)
        with REC.forward() as calls:
            out = model(xs, cache=cache)
            mx.eval(out)
        r = routing_rows(calls, n_moe)
        sources.update(c[0] for c in calls)
        if r is None:
            if ok:
                log(f"{label}: routing capture saw {[c[0] for c in calls]} "
                    f"(not one per MoE layer): routing not reported")
            ok = False
        else:
            for j in range(n_moe):
                routes[j].append(r[j])
        return out

    logits, times = teacher_forced_logits(model, ids, L, P, D, step, one=one)
    routing = [np.concatenate(r, axis=0) for r in routes] if ok else None
    return logits, routing, {**times, "routing_sources": sorted(sources)}


@contextlib.contextmanager
def decode_steps_eager():
    """Lily's compiled decode steps (``mlx_lily.patches.decode_graph``) built with an
    identity ``mx.compile``: the same step functions, kernels and launch counters (the
    one-launch MoE block ``moe_fused`` runs only there), run eagerly so that the routing
    wrappers see real arrays. Compiled steps are dropped before and after."""
    import mlx.core as mx
    from mlx_lily.patches import decode_graph as dg

    class _EagerMx:
        def __getattr__(self, name):
            return getattr(mx, name)

        @staticmethod
        def compile(fn, *args, **kwargs):
            return fn

    dg.drop_compiled_steps()
    saved, dg.mx = dg.mx, _EagerMx()
    try:
        yield
    finally:
        dg.mx = saved
        dg.drop_compiled_steps()


@contextlib.contextmanager
def fp32_params(model):
    """Every floating parameter in fp32 (quantised weights unchanged); restored by identity."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    saved = tree_flatten(model.parameters())
    try:
        model.set_dtype(mx.float32)
        yield model
    finally:
        model.update(tree_unflatten(saved))


# --------------------------------------------------------------------------
# metrics
# --------------------------------------------------------------------------
def sections(P: int, D: int) -> dict:
    return {"prefill": slice(0, P), "decode": slice(P, P + D), "all": slice(0, P + D)}


def compare_sections(ref, test, targets, P, D) -> dict:
    (rl, rr), (tl, tr) = ref, test
    out = {}
    for name, sl in sections(P, D).items():
        if sl.stop - sl.start <= 0:
            continue
        out[name] = compare(rl[sl], tl[sl], targets[sl],
                            None if rr is None else [r[sl] for r in rr],
                            None if tr is None else [r[sl] for r in tr])
    return out


def verdict(vs_stock: dict, lily_fp32: dict, stock_fp32: dict) -> dict:
    """The issue's targets on the ``all`` section: Lily vs stock, and Lily no further from
    fp32 than stock on each measure (None where routing was not captured)."""
    a, lf, sf = vs_stock["all"], lily_fp32["all"], stock_fp32["all"]
    r = a.get("routing_agreement_min")
    v = {
        "ppl": abs(a["ppl_rel_diff"]) <= TARGETS["ppl_rel_diff_max"],
        "top1": a["top1_agreement"] >= TARGETS["top1_agreement_min"],
        "routing": None if r is None else r >= TARGETS["routing_agreement_min"],
        "fp32_ppl": abs(lf["ppl_rel_diff"]) <= abs(sf["ppl_rel_diff"]),
        "fp32_top1": lf["top1_agreement"] >= sf["top1_agreement"],
        "fp32_kl": lf["kl_mean"] <= sf["kl_mean"],
    }
    if lf.get("routing_agreement_per_layer") and sf.get("routing_agreement_per_layer"):
        v["fp32_routing"] = all(x >= y for x, y in zip(lf["routing_agreement_per_layer"],
                                                       sf["routing_agreement_per_layer"]))
    v["all"] = all(x is not False for x in v.values())
    return v


def render(result: dict) -> str:
    """Markdown tables of the result (one per context)."""
    lines = [f"numerics_long: {result['checkpoint']} on {result['device']}"]
    for ctx in result["contexts"]:
        L = ctx["context"]
        lines += ["", f"### context {L} (measured: {ctx['measure_prefill']} prefill rows + "
                  f"{ctx['decode_steps']} decode steps)", "",
                  "| pair | section | ppl ref | ppl test | rel ppl | top-1 agree | mean KL | "
                  "max KL | routing per layer |", "|---|---|---|---|---|---|---|---|---|"]
        for pair, secs in ctx["pairs"].items():
            for s, m in secs.items():
                rt = m.get("routing_agreement_per_layer")
                rts = " / ".join(f"{x * 100:.2f}" for x in rt) + "%" if rt else "-"
                lines.append(f"| {pair} | {s} | {m['ppl_ref']:.4f} | {m['ppl_test']:.4f} | "
                             f"{m['ppl_rel_diff'] * 100:+.4f}% | {m['top1_agreement'] * 100:.2f}% | "
                             f"{m['kl_mean']:.2e} | {m['kl_max']:.2e} | {rts} |")
        for mode, v in ctx.get("verdicts", {}).items():
            lines.append(f"\ntargets lily-{mode}: " + ", ".join(f"{k}={v[k]}" for k in v))
        lines.append("\ntimes: " + ", ".join(
            f"{k} {t['context_prefill_s'] + t['measured_prefill_s'] + t['decode_s']:.1f}s "
            f"({t['decode_ms_per_step']:.1f} ms/step)" for k, t in ctx["times"].items()))
        lines.append("routing captured from: " + "; ".join(
            f"{k} {'+'.join(t['routing_sources']) or '-'}" for k, t in ctx["times"].items()))
    for mode, why in result.get("skipped_modes", {}).items():
        lines.append(f"\nskipped lily-{mode}: {why}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------
def build_parser():
    p = argparse.ArgumentParser(prog="python benchmarks/numerics_long.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="checkpoint folder with numerics_reference.json")
    p.add_argument("--contexts", default="4096,32768")
    p.add_argument("--measure-prefill", type=int, default=1024, help="rows of the measured chunk")
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--prefill-step", type=int, default=2048, help="chunk of the context prefill")
    p.add_argument("--kernels", default="default,all",
                   help="Lily modes, comma-separated: default (the verified set), all, ops "
                        "joined by '+' (MLX_LILY_KERNELS=op,op: one kernel's error alone), or "
                        "each (one mode per op of the default set, with what it requires)")
    p.add_argument("--no-fp32", action="store_true", help="skip the fp32 evaluation")
    p.add_argument("--no-lily", action="store_true", help="stock and fp32 only")
    p.add_argument("--out", type=Path, default=None, help="write the JSON result here")
    return p


def main(argv=None) -> int:
    """CLI entry point: prints the tables, writes ``--out``. Exit 0 (targets are reported,
    not enforced), 1 when a mode was skipped."""
    a = build_parser().parse_args(argv)
    t_start = time.perf_counter()

    def log(msg):
        print(f"[numerics_long {time.perf_counter() - t_start:7.1f}s] {msg}", file=sys.stderr,
              flush=True)

    import mlx.core as mx
    import mlx_lm

    ckpt = Path(a.model).expanduser()
    ref_path = ckpt / "numerics_reference.json"
    if not ref_path.is_file():
        raise SystemExit(f"numerics_long: {ref_path} not found (train with "
                         f"benchmarks/train_production_width.py)")
    ref = json.loads(ref_path.read_text())
    ids = [int(i) for i in ref["ids"]]
    contexts = [int(c) for c in a.contexts.split(",") if c.strip()]
    modes = [] if a.no_lily else [m.strip() for m in a.kernels.split(",") if m.strip()]
    kernels_of: dict = {}
    if "each" in modes:
        from mlx_lily import backend as lily_backend

        kernels_of["default"] = kernels_for_mode("default", log)
        each = each_op_modes(kernels_of["default"], lily_backend.current_backend())
        if not each:
            raise SystemExit("numerics_long: --kernels each: the default set has no op here "
                             f"({kernels_of['default']!r} on {lily_backend.current_backend()})")
        log(f"--kernels each: {len(each)} modes, one per op of the default set: "
            f"{', '.join(each)}")
        modes = [x for m in modes for x in (each if m == "each" else [m])]
        modes = list(dict.fromkeys(modes))
    kernels_of = {m: kernels_of.get(m) or kernels_for_mode(m, log) for m in modes}
    need = max(contexts) + a.decode_steps + 1
    if len(ids) < need:
        raise SystemExit(f"numerics_long: {ref_path} holds {len(ids)} ids; context "
                         f"{max(contexts)} + {a.decode_steps} decode steps need {need}")
    if any(a.measure_prefill < 1 or a.measure_prefill > c for c in contexts):
        raise SystemExit("numerics_long: --measure-prefill must be within 1..context")

    model, _ = mlx_lm.load(str(ckpt))
    tc = model.args.text_config if hasattr(model.args, "text_config") else {}
    n_layers = len(model.layers)
    n_moe = sum(1 for layer in model.layers if hasattr(layer.mlp, "switch_mlp"))
    install_capture()
    if modes:
        import mlx_lily
        from mlx_lily import config as lily_config

        for m in modes:  # a bad op name fails here, before any engine runs
            try:
                lily_config.parse_keyword("kernels", kernels_of[m])
            except ValueError as e:
                raise SystemExit(f"numerics_long: --kernels {m!r}: {e}") from None
    result = {"schema": SCHEMA, "schema_version": 1,
              "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
              "checkpoint": str(ckpt), "device": str(mx.default_device()),
              "versions": {"mlx": mx.__version__, "mlx_lm": mlx_lm.__version__},
              "reference": ref.get("source"), "layers": n_layers, "moe_layers": n_moe,
              "num_experts": tc.get("num_experts"), "top_k": tc.get("num_experts_per_tok"),
              "targets": TARGETS, "kernel_modes": kernels_of,
              "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MLX")},
              "contexts": []}
    if modes:
        result["versions"]["mlx_lily"] = mlx_lily.__version__
        with mlx_lily.patched(model):
            result["lily_backend_info"] = {k: str(v) for k, v in mlx_lily.backend_info().items()}
    P, D = a.measure_prefill, a.decode_steps
    for L in contexts:
        targets = ids[L - P + 1:L + 1] + ids[L + 1:L + D + 1]
        runs, times = {}, {}

        def go(label, capture, **kw):
            logits, routing, t = run_engine(model, ids, L, P, D, a.prefill_step,
                                            capture=capture, n_moe=n_moe, label=label, log=log)
            runs[label], times[label] = (logits, routing), t
            secs = t["context_prefill_s"] + t["measured_prefill_s"] + t["decode_s"]
            log(f"context {L}: {label} done ({secs:.1f}s; routing from {t['routing_sources']})")

        go("stock", True)
        if not a.no_fp32:
            with fp32_params(model):
                go("fp32", True)
        measured = []
        for m in modes:
            with mlx_lily.patched(model, kernels=kernels_of[m]):
                why = why_not_serving(m)
                if why is None:
                    go(f"lily-{m}", False)
            if why is not None:  # the other modes still run
                log(f"context {L}: {why}; skipped")
                result.setdefault("skipped_modes", {})[m] = why
                continue
            with mlx_lily.patched(model, kernels=kernels_of[m], compile=True):
                with decode_steps_eager():
                    go(f"lily-{m}-eager", True)
            measured.append(m)
        pairs, verdicts = {}, {}
        st = runs["stock"]
        if "fp32" in runs:
            pairs["fp32 -> stock"] = compare_sections(runs["fp32"], st, targets, P, D)
        for m in measured:
            ly, le = runs[f"lily-{m}"], runs[f"lily-{m}-eager"]
            ly_r = (ly[0], le[1])  # the compiled run's logits, the eager run's routing
            pairs[f"stock -> lily-{m}"] = compare_sections(st, ly_r, targets, P, D)
            if "fp32" in runs:
                pairs[f"fp32 -> lily-{m}"] = compare_sections(runs["fp32"], ly_r, targets, P, D)
                verdicts[m] = verdict(pairs[f"stock -> lily-{m}"], pairs[f"fp32 -> lily-{m}"],
                                      pairs["fp32 -> stock"])
            pairs[f"lily-{m} eager_vs_compiled"] = compare_sections((ly[0], None), (le[0], None),
                                                                    targets, P, D)
        result["contexts"].append({"context": L, "measure_prefill": P, "decode_steps": D,
                                   "prefill_step": a.prefill_step, "pairs": pairs,
                                   "verdicts": verdicts, "times": times})
        del runs
        mx.clear_cache()
        result["wall_s"] = time.perf_counter() - t_start
        write(result, a.out, complete=L == contexts[-1])  # a run cut short keeps what finished
        log(f"context {L} done")
    uninstall_capture()
    print(render(result))
    if a.out:
        log(f"wrote {a.out}")
    return 1 if result.get("skipped_modes") else 0


def write(result: dict, out: Path | None, complete: bool) -> None:
    """Write ``result`` (JSON, non-finite floats as null) to ``out`` and its tables to
    ``out`` with suffix ``.md``; ``complete`` False marks a partial result."""
    if out is None:
        return
    from mlx_lily.bench.ab import json_clean

    result["complete"] = complete
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(json_clean(result), indent=1, allow_nan=False) + "\n")
    out.with_suffix(".md").write_text(render(result))


if __name__ == "__main__":
    sys.exit(main())
