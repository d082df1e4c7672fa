"""Benchmarking knobs compared in one process: the model loads (and MLX compiles its
kernels) once, then every setting of a group runs each of the group's cases as
``mlx_lm.benchmark`` runs one (a warm-up generation, then ``--trials`` timed ones:
``stream_generate`` for one prompt, ``batch_generate`` for B; random prompts, seed 0 before
each generation; no end-of-sequence stop; prefill step 2048), the settings' order reversed
in every other round so that each setting's mean position is the same. A diagnostic for
choosing defaults: the figure users see is still ``mlx_lm.benchmark`` itself
(``user_bench.py``).

    python benchmarks/gpu/knob_sweep.py --model DIR --out DIR \\
        --group "512:128:2,512:128:8=default MLX_LILY_GDN_BATCH_FOLD=4" \\
        --group "32768:128:1=default MLX_LILY_DECODE_PF=2,MLX_LILY_ATTN_FIXED_BLOCK=512"

A group is ``CASES=SETTINGS``: CASES a comma list of ``P:G[:B]`` (prompt tokens, generation
tokens, batch), SETTINGS space-separated, each ``default`` or comma-joined ``VAR=VALUE`` of
``MLX_LILY_*`` knobs (``docs/tuning.md``) or user settings (``mlx_lily.config``), each
value checked by that variable's own parser. A setting's variables are set for its runs;
every variable any setting of the sweep names is removed before each cell (also one the
caller had set: ``default`` means the built-in value). Lily's kernels follow the
environment (``MLX_LILY_KERNELS``). Knobs are part of the compiled decode steps' key, so
each setting traces its own steps in its warm-up.

Writes ``knob_sweep.json`` and ``picks.env`` after every cell (a run cut by a time limit
keeps what it measured); a cell whose case took longer last time than the budget has left
is skipped: per group, case and setting the timed ``generation_tps`` / ``prompt_tps`` of
every trial (``peak_memory`` is the process's high-water mark so far, not the cell's;
``end_unix`` when the trial ended); per group the settings' ratio to ``default`` (geometric mean over the cases of
the mean generation tok/s) and ``pick``, the setting kept by :func:`pick_setting`. Also
``picks.env`` holds the ``VAR=VALUE`` lines of the picked settings, for a later step.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from user_bench import parse_case  # noqa: E402

#: A setting must beat ``default`` by this factor (geometric mean over the group's cases)...
MIN_GAIN = 1.03
#: ...and lose no case by more than this factor, to be picked.
MAX_LOSS = 0.98


def parse_setting(text: str) -> dict:
    """``"default"`` -> ``{}``; ``"A=1,B=2"`` -> ``{"A": "1", "B": "2"}``; an item without
    ``=`` continues the previous value (``"A=2,4,1,B=2"`` -> ``{"A": "2,4,1", "B": "2"}``).

    Raises:
        ValueError: an item is not ``VAR=VALUE`` with a variable of ``mlx_lily.tuning`` or
            ``mlx_lily.config``, or the value is one that variable does not accept.
    """
    if text == "default":
        return {}
    out, last = {}, None
    for item in text.split(","):
        if "=" not in item and last is not None:  # a value with commas: "A=2,4,1"
            out[last] += "," + item
            continue
        var, eq, val = item.partition("=")
        if not eq or not var.startswith("MLX_LILY_") or not val:
            raise ValueError(f"setting {text!r}: {item!r} is not MLX_LILY_<NAME>=VALUE")
        out[var], last = val, var
    for var, val in out.items():
        _check_value(text, var, val)
    return out


def _check_value(text: str, var: str, val: str) -> None:
    """``ValueError`` unless ``var`` is a knob or user setting that accepts ``val``."""
    from mlx_lily import config, tuning
    from mlx_lily.config import BadValue

    table = {s.env: s for s in (*tuning.KNOBS.values(), *config.SETTINGS.values())}
    if var not in table:
        raise ValueError(f"setting {text!r}: {var} is no mlx-lily knob or setting")
    try:
        table[var].parse(val.strip())
    except BadValue:
        raise ValueError(f"setting {text!r}: {var}={val!r} is not accepted "
                         f"({table[var].accepted})") from None


def parse_group(text: str) -> dict:
    """``"CASES=SETTINGS"`` -> ``{"cases": [(P, G, B), ...], "settings": [str, ...]}``;
    ``default`` is added first when missing (every ratio is to it).

    Raises:
        ValueError: no ``=`` between cases and settings, a bad case or a bad setting.
    """
    cases, eq, settings = text.partition("=")
    if not eq or not settings.strip():
        raise ValueError(f"--group {text!r}: expected CASES=SETTINGS")
    names = settings.split()
    for s in names:
        parse_setting(s)
    if "default" not in names:
        names.insert(0, "default")
    return {"cases": [parse_case(c) for c in cases.split(",")], "settings": names}


def round_order(items: list, k: int) -> list:
    """The settings' order in round ``k``: as given in even rounds, reversed in odd ones
    (over each pair of rounds every setting's mean position is the same)."""
    return list(items) if k % 2 == 0 else list(reversed(items))


def pick_setting(ratios: dict, worst: dict) -> str:
    """The setting to keep: the highest geometric-mean ratio to ``default`` that is at
    least ``MIN_GAIN`` and whose worst case is at least ``MAX_LOSS``; else ``default``.
    ``ratios``/``worst``: setting -> float (``default`` may be absent)."""
    best, best_r = "default", MIN_GAIN
    for s, r in ratios.items():
        if s != "default" and r is not None and r >= best_r and worst.get(s, 0) >= MAX_LOSS:
            best, best_r = s, r
    return best


def summarize(group: dict, cells: dict) -> dict:
    """Per setting: geometric-mean ratio of its mean generation tok/s to ``default``'s over
    the cases both measured, and its worst case ratio; plus the pick."""
    ratios, worst = {}, {}
    for s in group["settings"]:
        logs, low = [], None
        for c in group["cases"]:
            key = case_key(c)
            base = _mean(cells.get(key, {}).get("default"))
            mine = _mean(cells.get(key, {}).get(s))
            if base and mine:
                r = mine / base
                logs.append(math.log(r))
                low = r if low is None else min(low, r)
        ratios[s] = round(math.exp(sum(logs) / len(logs)), 4) if logs else None
        worst[s] = round(low, 4) if low is not None else None
    return {"ratio_to_default": ratios, "worst_case_ratio": worst,
            "pick": pick_setting(ratios, worst)}


def case_key(case) -> str:
    return "{}:{}:{}".format(*case)


def _mean(cell) -> float | None:
    vals = [t["generation_tps"] for t in (cell or {}).get("trials", [])]
    return statistics.fmean(vals) if vals else None


class Runner:
    """Runs one case the way ``mlx_lm.benchmark`` does, on a loaded model."""

    def __init__(self, model_path: str):
        import mlx.core as mx
        import mlx_lm

        self.mx = mx
        self.mlx_lm = mlx_lm
        self.model, self.tokenizer, self.config = mlx_lm.load(
            model_path, return_config=True, tokenizer_config={"trust_remote_code": True})
        self.tokenizer._eos_token_ids = {}  # as mlx_lm.benchmark: no early stop
        self.vocab = self.config.get("vocab_size") or self.config["text_config"]["vocab_size"]

    def once(self, p: int, g: int, b: int):
        mx = self.mx
        mx.random.seed(0)
        prompts = mx.random.randint(0, self.vocab, (b, p)).tolist()
        if b == 1:
            resp = None
            for resp in self.mlx_lm.stream_generate(self.model, self.tokenizer, prompts[0],
                                                    max_tokens=g, prefill_step_size=2048):
                pass
            return resp
        return self.mlx_lm.batch_generate(self.model, self.tokenizer, prompts, max_tokens=g,
                                          prefill_step_size=2048).stats

    def cell(self, case, trials: int) -> dict:
        t0 = time.perf_counter()
        self.once(*case)  # warm-up: traces this setting's compiled steps
        out = []
        for _ in range(trials):
            r = self.once(*case)
            t = {k: round(float(getattr(r, k)), 3)
                 for k in ("prompt_tps", "generation_tps", "peak_memory")}
            now = time.time()  # to line up with a clock log (nvidia-smi's local time)
            t["end_unix"] = round(now, 2)
            t["end_local"] = time.strftime("%Y/%m/%d %H:%M:%S", time.localtime(now))
            out.append(t)
        return {"trials": out, "wall_s": round(time.perf_counter() - t0, 2)}


def apply_env(setting: dict, all_vars: set, environ=os.environ) -> None:
    """Remove every variable of ``all_vars`` from ``environ``, then set ``setting``'s."""
    for v in all_vars:
        environ.pop(v, None)
    environ.update(setting)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--group", action="append", required=True,
                    help="CASES=SETTINGS (see the module docstring); repeatable")
    ap.add_argument("--trials", type=int, default=2, help="timed generations per cell")
    ap.add_argument("--rounds", type=int, default=2,
                    help="passes over each group's settings, order reversed every other pass")
    ap.add_argument("--budget-s", type=float, default=0,
                    help="start no new cell after this many seconds (0: no limit)")
    ap.add_argument("--stock", action="store_true", help="do not patch (stock mlx-lm)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    try:
        groups = [parse_group(g) for g in args.group]
    except ValueError as e:
        ap.error(str(e))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    import mlx.core as mx

    if not args.stock:
        import mlx_lily

        mlx_lily.patch(announce=True)
    runner = Runner(args.model)
    all_vars = {v for g in groups for s in g["settings"] for v in parse_setting(s)}
    result = {"model": args.model, "device": str(mx.device_info().get("device_name", "")),
              "arm": "stock" if args.stock else "lily",
              "kernels": os.environ.get("MLX_LILY_KERNELS", ""),
              "commit": os.environ.get("MLX_LILY_TREE_REV", ""), "trials": args.trials,
              "rounds": args.rounds, "load_s": round(time.perf_counter() - t_start, 1),
              "groups": []}
    if not args.stock:
        import mlx_lily

        result["backend_info"] = mlx_lily.backend_info()
    path = out_dir / "knob_sweep.json"

    def save():
        path.write_text(json.dumps(result, indent=1, default=str))
        picks = {}
        for g in result["groups"]:
            picks.update(parse_setting(g.get("pick", "default")))
        (out_dir / "picks.env").write_text("".join(f"{k}={v}\n" for k, v in sorted(picks.items())))

    last_wall: dict = {}  # case -> seconds its last cell took

    stopped = False
    for g in groups:
        cells: dict = {}
        entry = {"cases": [case_key(c) for c in g["cases"]], "settings": g["settings"],
                 "cells": cells}
        result["groups"].append(entry)
        for rnd in range(args.rounds):
            for s in round_order(g["settings"], rnd):
                for c in g["cases"]:
                    left = args.budget_s - (time.perf_counter() - t_start)
                    if args.budget_s and left < last_wall.get(case_key(c), 0.0):
                        stopped = True
                        break
                    apply_env(parse_setting(s), all_vars)
                    slot = cells.setdefault(case_key(c), {}).setdefault(
                        s, {"trials": [], "wall_s": 0.0})
                    try:
                        got = runner.cell(c, args.trials)
                        last_wall[case_key(c)] = got["wall_s"]
                        slot["trials"] += got["trials"]
                        slot["wall_s"] = round(slot["wall_s"] + got["wall_s"], 2)
                    except Exception as e:  # recorded; the sweep goes on
                        slot.setdefault("errors", []).append(f"{type(e).__name__}: {e}"[:500])
                    print(f"[{time.perf_counter() - t_start:7.1f} s] round {rnd} {case_key(c)} "
                          f"{s}: {[t['generation_tps'] for t in slot['trials']]}", flush=True)
                    entry.update(summarize(g, cells))
                    save()
                if stopped:
                    break
            if stopped:
                break
        apply_env({}, all_vars)
        entry.update(summarize(g, cells))
        save()
    result["stopped_by_budget"] = stopped
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    save()
    for g in result["groups"]:
        print(f"cases {g['cases']}: ratios {g.get('ratio_to_default')} -> pick {g.get('pick')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
