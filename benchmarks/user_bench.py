"""The figures users see: ``mlx_lm.benchmark`` stock and ``--lily``, same machine, same call.

Each case (prompt tokens, generation tokens, batch size) runs mlx-lm's own benchmark
command once per arm as a child process (``python -m mlx_lm.benchmark --model DIR -p P -g G
-b B -n N [--lily]``), the arms alternating and the order reversed from one case to the
next. The figures are mlx-lm's own "Averages" line: ``prompt_tps`` and ``generation_tps``
(for B > 1 mlx-lm reports the aggregate over the batch) and ``peak_memory`` (GB), the mean
over its trials. Writes ``user_bench.json`` and ``user_bench.md`` to ``--out``.

    python benchmarks/user_bench.py --model DIR --cases 512:128:1,4096:128:1,512:128:2 --out DIR

A case whose child fails or runs past ``--timeout-s`` is recorded with its error and the
last lines of its output; the others still run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

AVERAGES = re.compile(r"^Averages:\s*(.*)$", re.M)
TRIAL = re.compile(r"^Trial (\d+):\s*(.*)$", re.M)
PAIR = re.compile(r"(\w+)=([-+0-9.eE]+)")
ARMS = ("stock", "lily")


def parse_case(text: str) -> tuple[int, int, int]:
    """``"P:G[:B]"`` -> (prompt tokens, generation tokens, batch size).

    Raises:
        ValueError: not two or three positive integers separated by ``:``.
    """
    parts = text.split(":")
    if len(parts) not in (2, 3) or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"--cases: {text!r} is not P:G or P:G:B with positive integers")
    p, g, *b = (int(x) for x in parts)
    return p, g, (b[0] if b else 1)


def lily_env(environ) -> dict:
    """The ``MLX_LILY_*`` variables of ``environ`` (kernel set, benchmarking knobs) that
    the children inherit, sorted by name."""
    return {k: environ[k] for k in sorted(environ) if k.startswith("MLX_LILY")}


def parse_output(text: str) -> dict:
    """mlx-lm's benchmark output -> ``{"averages": {...}, "trials": [{...}, ...]}``
    (floats; empty when the line is missing)."""
    out = {"averages": {}, "trials": []}
    m = AVERAGES.findall(text)
    if m:
        out["averages"] = {k: float(v) for k, v in PAIR.findall(m[-1])}
    for _, rest in TRIAL.findall(text):
        out["trials"].append({k: float(v) for k, v in PAIR.findall(rest)})
    return out


def bench_command(model: str, p: int, g: int, b: int, trials: int, arm: str,
                  extra: list[str]) -> list[str]:
    """The child's argv for one arm of one case."""
    cmd = [sys.executable, "-m", "mlx_lm.benchmark", "--model", model, "-p", str(p),
           "-g", str(g), "-b", str(b), "-n", str(trials), *extra]
    return cmd + (["--lily"] if arm == "lily" else [])


def run_arm(cmd: list[str], timeout_s: float, env: dict) -> dict:
    """Run one child; its parsed figures, wall time and, on failure, the error."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        text, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc = "timeout"
    res = parse_output(text)
    res["wall_s"] = round(time.perf_counter() - t0, 2)
    res["command"] = " ".join(cmd[1:])
    if rc != 0 or not res["averages"]:
        res["error"] = f"exit {rc}"
        res["tail"] = text.strip().splitlines()[-12:]
    return res


def render_markdown(result: dict) -> str:
    """One table: case, then each arm's prompt / generation tok/s and peak GB, then
    Lily over stock for generation."""
    lines = [f"# mlx_lm.benchmark, stock vs --lily ({result['device']})", "",
             f"Model: `{result['model']}`; trials per arm: {result['trials']}; "
             f"mlx {result['versions'].get('mlx')}, mlx-lm {result['versions'].get('mlx_lm')}, "
             f"mlx-lily {result['versions'].get('mlx_lily')}; commit {result['commit']}.", "",
             "Figures are mlx-lm's own `Averages` line (mean over its trials; for B > 1 "
             "the aggregate over the batch).", "",
             "| prompt | gen | batch | stock prompt tok/s | stock gen tok/s | lily prompt tok/s "
             "| lily gen tok/s | gen lily/stock | stock peak GB | lily peak GB |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def cell(arm, key, spec="{:,.1f}"):
        v = arm.get("averages", {}).get(key)
        return spec.format(v) if v is not None else ("error" if arm.get("error") else "-")

    for c in result["cases"]:
        s, l = c["arms"].get("stock", {}), c["arms"].get("lily", {})
        sg, lg = s.get("averages", {}).get("generation_tps"), l.get("averages", {}).get("generation_tps")
        ratio = f"{lg / sg:.2f}x" if sg and lg else "-"
        lines.append(f"| {c['prompt']} | {c['gen']} | {c['batch']} | {cell(s, 'prompt_tps')} | "
                     f"{cell(s, 'generation_tps')} | {cell(l, 'prompt_tps')} | "
                     f"{cell(l, 'generation_tps')} | {ratio} | {cell(s, 'peak_memory', '{:.2f}')} | "
                     f"{cell(l, 'peak_memory', '{:.2f}')} |")
    return "\n".join(lines) + "\n"


def _versions() -> dict:
    out = {}
    for mod in ("mlx", "mlx_lm", "mlx_lily"):
        try:
            m = __import__(mod + (".core" if mod == "mlx" else ""), fromlist=["x"])
            out[mod] = getattr(m, "__version__", None)
        except Exception as e:  # a missing package is reported, not fatal
            out[mod] = f"unavailable: {e}"
    return out


def _device() -> str:
    try:
        import mlx.core as mx

        info = mx.device_info()
        return str(info.get("device_name") or info.get("architecture") or platform.machine())
    except Exception:
        return platform.machine()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--cases", default="512:128:1,4096:128:1",
                    help="comma list of P:G[:B] (prompt tokens, generation tokens, batch)")
    ap.add_argument("--trials", type=int, default=3, help="mlx_lm.benchmark -n")
    ap.add_argument("--arms", default="stock,lily", help="which arms to run")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="limit per child process")
    ap.add_argument("--extra", default="", help="more mlx_lm.benchmark options, one string")
    ap.add_argument("--out", default="user-bench", help="output directory")
    opts = ap.parse_args(argv)
    cases = [parse_case(c) for c in opts.cases.split(",") if c.strip()]
    arms = [a.strip() for a in opts.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        ap.error(f"--arms: unknown {bad}; accepted: {', '.join(ARMS)}")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("MLX_LILY", None)  # the stock arm must be stock
    result = {"model": opts.model, "trials": opts.trials, "device": _device(),
              "versions": _versions(), "commit": os.environ.get("MLX_LILY_TREE_REV", "unknown"),
              "lily_env": lily_env(os.environ), "cases": []}
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    for i, (p, g, b) in enumerate(cases):
        order = arms if i % 2 == 0 else arms[::-1]
        case = {"prompt": p, "gen": g, "batch": b, "order": order, "arms": {}}
        for arm in order:
            cmd = bench_command(opts.model, p, g, b, opts.trials, arm, opts.extra.split())
            r = case["arms"][arm] = run_arm(cmd, opts.timeout_s, env)
            figs = r.get("averages", {})
            print(f"p={p} g={g} b={b} {arm:5s}: prompt {figs.get('prompt_tps', float('nan')):.1f} "
                  f"gen {figs.get('generation_tps', float('nan')):.1f} tok/s "
                  f"({r['wall_s']} s){'  ' + r['error'] if 'error' in r else ''}", flush=True)
        result["cases"].append(case)
        (out / "user_bench.json").write_text(json.dumps(result, indent=1))
        (out / "user_bench.md").write_text(render_markdown(result))
    print(render_markdown(result))
    return 0 if all("error" not in a for c in result["cases"] for a in c["arms"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
