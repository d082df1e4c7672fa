"""Per-kernel GPU time of decode steps, read by Nsight Compute (``ncu``): which kernels a
stock and a Lily decode step launch, how many times, and how long each runs on the GPU
(``gpu__time_duration``, kernels serialised by the profiler, clocks left alone); with
``--phase prefill`` the same for one prefill chunk.

    python benchmarks/gpu/kernel_times.py --context 4096 --steps 2 --out DIR
    python benchmarks/gpu/kernel_times.py --context 512 --batch 8 --arms lily --out DIR
    python benchmarks/gpu/kernel_times.py --phase prefill --context 2048 --chunk 2048 \
        --arms lily --steps 1 --out DIR

Runs itself under ``ncu --profile-from-start off`` once per arm: the child process
(``MLX_USE_CUDA_GRAPHS=0``: ncu read no kernel replayed from MLX's CUDA graphs) loads the
synthetic model, builds a ``--context``-token cache with Lily's prefill, decodes
``--warmup`` steps, then turns the profiler on (``cudaProfilerStart`` through ctypes) for
``--steps`` decode steps only (of ``--batch`` copies of that cache merged into mlx-lm's
batch caches when it is over 1), between two one-thread marker kernels; if that records
nothing, once more profiling everything, the rows cut at the markers. The sum over a
step's kernels is the GPU's busy time with no gaps between kernels (a lower bound on the
step's device time; the difference to ``decode_profile.py --gpu-only``'s step time is
launch gaps and idle). ``--detail REGEX``: Nsight Compute's sections (registers per
thread, occupancy, throughput, warp states) for the first ``--detail-count`` launches
matching REGEX, into DIR/kernel_detail.json. Writes DIR/kernel_times.json (per arm: per
kernel name launches per step, us per step, mean us per launch) and prints the top
kernels. Needs ``ncu`` (Nsight Compute) on a machine whose runtime lets it read the GPU
(the lent H200's Firecracker does).
"""
from __future__ import annotations

import argparse
import csv
import ctypes
import glob
import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path


def find_ncu() -> str | None:
    """Path of the ``ncu`` executable (PATH, then /opt/nvidia/nsight-compute/*/), or None."""
    p = shutil.which("ncu")
    if p:
        return p
    hits = sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu")) + sorted(
        glob.glob("/usr/local/cuda*/bin/ncu"))
    return hits[-1] if hits else None


def _cudart():
    """The CUDA runtime library MLX loaded (for cudaProfilerStart/Stop), or None."""
    names = ["libcudart.so.13", "libcudart.so.12", "libcudart.so"]
    try:
        import nvidia.cu13  # noqa: F401  (MLX's CUDA wheel ships the runtime here)

        # a namespace package on the lent machine (``__file__`` is None): its __path__
        for base in getattr(nvidia.cu13, "__path__", []):
            names = sorted(glob.glob(os.path.join(base, "lib", "libcudart.so*"))) + names
    except ImportError:
        pass
    for n in names:
        try:
            return ctypes.CDLL(n)
        except OSError:
            continue
    return None


MARK_BEGIN, MARK_END = "lily_ncu_mark_begin", "lily_ncu_mark_end"


def _marker(name: str):
    """A function launching a one-thread kernel named ``name`` (its row in ncu's table
    delimits the measured kernels), or None off CUDA."""
    import mlx.core as mx

    if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
        return None
    k = mx.fast.cuda_kernel(name=name, input_names=["x"], output_names=["y"],
                            source="if (threadIdx.x == 0) { y[0] = x[0]; }")
    x = mx.zeros((1,), mx.float32)

    def launch():
        (y,) = k(inputs=[x], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)],
                 output_dtypes=[mx.float32])
        mx.eval(y)
        mx.synchronize()

    return launch


def child(a) -> int:
    """Inside ncu: ``a.steps`` decode steps (or prefill chunks) of arm ``a.arm`` between
    two marker kernels, with the profiler API switched on around them."""
    os.environ.setdefault("MLX_LILY_KERNELS", "all")
    import mlx.core as mx

    begin, end = _marker(MARK_BEGIN), _marker(MARK_END)
    if begin is not None:  # compile them outside the measured range
        begin()
        end()

    from mlx_lily.bench.ab import (arm_context, build_context, copy_cache, load_target,
                                   synthetic_ids, vocab_bounds)

    rt = _cudart()
    if rt is None:
        print("kernel_times: no libcudart to start the profiler", file=sys.stderr)
        return 2
    from mlx_lily import synth

    preset = synth.preset_config(a.preset, layers=a.layers or None)
    t = load_target(None, synthetic=preset)
    hi, ex = vocab_bounds(t.config, t.tokenizer)
    ids = synthetic_ids(a.context + 1, hi, ex, seed=0)
    with arm_context("lily", t.model, None):
        ctx = build_context(t.model, ids[:a.context], 2048)
    if a.phase == "prefill":
        chunk = mx.array([synthetic_ids(a.chunk, hi, ex, seed=1).tolist()])
        with arm_context(a.arm, t.model, None):
            for rnd in range(1 + a.steps):  # an untimed chunk first (kernel compiles)
                cache = copy_cache(ctx)
                mx.synchronize()
                if rnd:
                    rt.cudaProfilerStart()
                    if begin is not None:
                        begin()
                # a middle chunk of mlx-lm's prefill: the cache state, not the logits (its
                # last chunk also runs the LM head over every position)
                t.model(chunk, cache=cache)
                mx.eval([c.state for c in cache])
                mx.synchronize()
                if rnd:
                    if end is not None:
                        end()
                    rt.cudaProfilerStop()
        return 0
    with arm_context(a.arm, t.model, None):
        cache = batch_of(ctx, a.batch, copy_cache)
        tok = mx.array([[int(ids[a.context])]] * a.batch)
        for _ in range(max(1, a.warmup)):
            y = mx.argmax(t.model(tok, cache=cache)[:, -1, :], axis=-1)
            mx.eval(y)
            tok = y.reshape(a.batch, 1)
        mx.synchronize()
        rt.cudaProfilerStart()
        if begin is not None:
            begin()
        for _ in range(a.steps):
            y = mx.argmax(t.model(tok, cache=cache)[:, -1, :], axis=-1)
            mx.eval(y)
            tok = y.reshape(a.batch, 1)
        mx.synchronize()
        if end is not None:
            end()
        rt.cudaProfilerStop()
    return 0


def batch_of(ctx: list, batch: int, copy_cache) -> list:
    """The decode cache of ``--batch`` sequences: ``ctx`` itself copied (``batch`` 1), or
    ``batch`` copies of it merged per layer as ``BatchGenerator`` merges its rows
    (``KVCache.merge`` -> ``BatchKVCache``, ``ArraysCache.merge``): one length, so no
    row is left-padded, as in ``mlx_lm.benchmark -b N``."""
    if batch == 1:
        return copy_cache(ctx)
    copies = [copy_cache(ctx) for _ in range(batch)]
    return [type(layer[0]).merge(list(layer)) for layer in zip(*copies)]


def measured(kernels: list) -> list:
    """The rows strictly between each ``MARK_BEGIN`` row and the next ``MARK_END`` row
    (all rows but markers when there are none)."""
    if not any(MARK_BEGIN in n for n, _ in kernels):
        return [(n, d) for n, d in kernels if MARK_END not in n]
    out, inside = [], False
    for n, d in kernels:
        if MARK_BEGIN in n:
            inside = True
        elif MARK_END in n:
            inside = False
        elif inside:
            out.append((n, d))
    return out


GRID_SEP = " @grid "


def _csv_table(text: str) -> list:
    """The rows of ncu's ``--csv`` table (header first; lines before its ``"ID"`` header
    ignored), or [] when there is none."""
    lines = text.splitlines()
    start = next((i for i, l in enumerate(lines) if l.startswith('"ID"')), None)
    return [] if start is None else list(csv.reader(io.StringIO("\n".join(lines[start:]))))


def parse_ncu_csv(text: str, with_grid: bool = False) -> list:
    """``[(kernel name, duration ns), ...]`` from ``ncu --csv --page raw`` output with the
    ``gpu__time_duration.sum`` metric (lines before the CSV header ignored); with
    ``with_grid`` each name carries its launch's grid (``GRID_SEP``) where the table has a
    "Grid Size" column, so one kernel's launches of different shapes stay apart (MLX's
    ``qmm_naive_kernel`` served two projections in one prefill table)."""
    rows = _csv_table(text)
    if not rows:
        return []
    head = rows[0]
    name_col = head.index("Kernel Name")
    dur_col = head.index("gpu__time_duration.sum")
    grid_col = head.index("Grid Size") if with_grid and "Grid Size" in head else None
    out = []
    for r in rows[1:]:
        if len(r) <= max(name_col, dur_col, grid_col or 0):
            continue
        try:
            ns = float(r[dur_col].replace(",", ""))
        except ValueError:
            continue  # the units row
        name = r[name_col]
        if grid_col is not None and r[grid_col]:
            name += GRID_SEP + r[grid_col]
        out.append((name, ns))
    return out


def summarize(kernels: list, steps: int) -> dict:
    """Per kernel name: launches per step, us per step, mean us per launch; plus totals."""
    by: dict = {}
    for name, ns in kernels:
        base, _, grid = name.partition(GRID_SEP)
        short = base.split("(")[0].split("<")[0].strip() + (f" grid{grid}" if grid else "")
        e = by.setdefault(short, [0, 0.0])
        e[0] += 1
        e[1] += ns / 1e3
    table = {k: {"launches_per_step": n / steps, "us_per_step": us / steps,
                 "mean_us": us / n} for k, (n, us) in by.items()}
    table = dict(sorted(table.items(), key=lambda kv: -kv[1]["us_per_step"]))
    return {"kernels_per_step": len(kernels) / steps,
            "busy_us_per_step": sum(ns for _, ns in kernels) / 1e3 / steps,
            "by_kernel": table}


def _run_ncu(ncu: str, opts: list, log: Path, arm: str, a) -> tuple:
    """Run this script's child for ``arm`` under ``ncu opts`` (CSV into ``log``); returns
    ``(returncode or "timeout", stderr tail, log text)``."""
    log.unlink(missing_ok=True)
    cmd = [ncu, "--clock-control", "none", *opts, "--csv", "--print-units", "base",
           "--log-file", str(log), sys.executable, os.path.abspath(__file__), "--child-arm",
           arm, "--preset", a.preset, "--layers", str(a.layers), "--context", str(a.context),
           "--steps", str(a.steps),
           "--warmup", str(a.warmup), "--phase", a.phase, "--chunk", str(a.chunk),
           "--batch", str(a.batch)]
    # kernels replayed from a CUDA graph were not read by ncu on the H200 (only a
    # stray copy kernel per run), so the child launches them one by one
    env = dict(os.environ, MLX_USE_CUDA_GRAPHS="0")
    # a session of its own: on a timeout the whole group goes, the profiled child too
    # (killing ncu alone left the child holding the GPU's memory for the next step)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, start_new_session=True)
    try:
        _, err = p.communicate(timeout=a.timeout_s)
        rc, err = p.returncode, err[-2000:]
    except subprocess.TimeoutExpired:
        _kill_group(p)
        rc, err = "timeout", ""
    return rc, err, log.read_text() if log.exists() else ""


def _kill_group(p: subprocess.Popen) -> None:
    """SIGKILL ``p``'s process group (``p`` started with ``start_new_session``) and reap
    ``p``."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    p.communicate()


#: Nsight Compute sections read by ``--detail``.
DETAIL_SECTIONS = ("SpeedOfLight", "LaunchStats", "Occupancy", "WarpStateStats",
                   "SchedulerStats", "MemoryWorkloadAnalysis")


def parse_ncu_details(text: str) -> list:
    """Launches from ``ncu --csv --page details`` output: ``[{"id", "name", "grid",
    "block", "metrics": {"Section / Metric": "value unit"}}]`` in launch order."""
    rows = _csv_table(text)
    if not rows:
        return []
    head = rows[0]
    col = {k: head.index(k) for k in ("ID", "Kernel Name", "Section Name", "Metric Name",
                                      "Metric Unit", "Metric Value") if k in head}
    if len(col) < 6:
        return []
    grid = head.index("Grid Size") if "Grid Size" in head else None
    block = head.index("Block Size") if "Block Size" in head else None
    out: dict = {}
    for r in rows[1:]:
        if len(r) < len(head):
            continue
        e = out.setdefault(r[col["ID"]], {
            "id": r[col["ID"]], "name": r[col["Kernel Name"]],
            "grid": r[grid] if grid is not None else None,
            "block": r[block] if block is not None else None, "metrics": {}})
        if not r[col["Metric Name"]]:
            continue  # rule rows (newer ncu) carry no metric
        unit = r[col["Metric Unit"]]
        e["metrics"][f"{r[col['Section Name']]} / {r[col['Metric Name']]}"] = (
            r[col["Metric Value"]] + (f" {unit}" if unit else ""))
    return list(out.values())


def parse_ncu_raw(text: str) -> list:
    """Launches from ``ncu --csv --page raw`` output: ``[{"id", "name", "grid", "block",
    "metrics": {"metric name": "value unit"}}]`` in launch order, every column that is not
    one of the launch's identifying columns taken as a metric (the units row, whose ID is
    empty, gives the units)."""
    rows = _csv_table(text)
    if len(rows) < 2:
        return []
    head = rows[0]
    ident = {"ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context",
             "Stream", "Block Size", "Grid Size", "Device", "CC"}
    units = rows[1] if rows[1] and rows[1][0] == "" else [""] * len(head)
    col = {k: head.index(k) for k in ("ID", "Kernel Name", "Grid Size", "Block Size") if k in head}
    if "ID" not in col or "Kernel Name" not in col:
        return []
    out = []
    for r in rows[1:]:
        if len(r) < len(head) or r[col["ID"]] == "":
            continue
        out.append({
            "id": r[col["ID"]], "name": r[col["Kernel Name"]],
            "grid": r[col["Grid Size"]] if "Grid Size" in col else None,
            "block": r[col["Block Size"]] if "Block Size" in col else None,
            "metrics": {h: r[i] + (f" {units[i]}" if i < len(units) and units[i] else "")
                        for i, h in enumerate(head) if h not in ident}})
    return out


def detail(ncu: str, a) -> dict:
    """``--detail``: the Nsight Compute sections ``DETAIL_SECTIONS`` for the first
    ``--detail-count`` launches whose name matches ``a.detail`` (a regex), per arm."""
    res = {"phase": a.phase, "context": a.context, "detail": a.detail, "ncu": ncu, "arms": {}}
    for arm in a.arms.split(","):
        log = Path(os.environ.get("TMPDIR", "/tmp")) / f"kernel_detail_{arm}.csv"
        # the profiler API range first; everything (the first matches) if it read nothing
        for from_start in ("off", "on"):
            # the raw page: one row per launch, one column per metric of the sections
            # (a details page parsed to launches without metric rows)
            opts = ["--profile-from-start", from_start, "-k", f"regex:{a.detail}", "-c",
                    str(a.detail_count), "--page", "raw"]
            for sec in DETAIL_SECTIONS:
                opts += ["--section", sec]
            rc, err, text = _run_ncu(ncu, opts, log, arm, a)
            launches = parse_ncu_raw(text) or parse_ncu_details(text)
            if launches:
                break
        if not launches:
            res["arms"][arm] = {"error": f"rc={rc}", "stderr": err, "log_head": text[:2000]}
            print(f"{arm}: no launch matched {a.detail!r} (rc={rc})\n{err}\n{text[:2000]}",
                  flush=True)
            continue
        res["arms"][arm] = launches
        if not any(e["metrics"] for e in launches):  # keep what ncu wrote, to fix the parser
            res.setdefault("raw_csv_head", {})[arm] = text[:6000]
            print(f"{arm}: launches matched but no metric rows were parsed; raw CSV head kept "
                  "in kernel_detail.json", flush=True)
        for e in launches:
            print(f"\n{arm}: {e['name'][:100]} grid {e['grid']} block {e['block']}")
            for k, v in e["metrics"].items():
                print(f"  {k[:70]:70s} {v}")
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    p.add_argument("--preset", default="qwen3.6-35b-a3b")
    p.add_argument("--layers", type=int, default=0,
                   help="the preset's first N layers only (0: all); a small model keeps "
                        "--detail's replays short (ncu saves and restores the device "
                        "memory around each replay pass)")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--arms", default="stock,lily")
    p.add_argument("--phase", choices=("decode", "prefill"), default="decode",
                   help="prefill: one --chunk-token forward after the --context cache "
                        "(--steps such forwards profiled)")
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--batch", type=int, default=1,
                   help="decode: sequences per step (copies of the context in mlx-lm's "
                        "batch caches)")
    p.add_argument("--detail", default=None, metavar="REGEX",
                   help="instead of the table: Nsight Compute's sections (registers, "
                        "occupancy, throughput, warp states) for launches matching REGEX")
    p.add_argument("--detail-count", type=int, default=2,
                   help="launches --detail profiles per arm")
    p.add_argument("--by-grid", action="store_true",
                   help="one row per (kernel, grid size): launches of one kernel for "
                        "different shapes apart")
    p.add_argument("--timeout-s", type=float, default=240.0, help="per arm")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--child-arm", dest="arm", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.arm:
        return child(a)
    ncu = find_ncu()
    if ncu is None:
        print("kernel_times: ncu (Nsight Compute) not found", file=sys.stderr)
        return 2
    if a.detail:
        res = detail(ncu, a)
        if a.out:
            a.out.mkdir(parents=True, exist_ok=True)
            (a.out / "kernel_detail.json").write_text(json.dumps(res, indent=2))
        return 0
    res = {"phase": a.phase, "context": a.context, "chunk": a.chunk if a.phase == "prefill"
           else None, "batch": a.batch, "steps": a.steps, "ncu": ncu, "arms": {}}
    for arm in a.arms.split(","):
        log = Path(os.environ.get("TMPDIR", "/tmp")) / f"kernel_times_{arm}.csv"
        # first with the profiler API range only; if that records nothing (the range did
        # not reach the context MLX uses), everything, cut at the marker kernels
        for from_start in ("off", "on"):
            rc, err, text = _run_ncu(
                ncu, ["--profile-from-start", from_start, "--metrics",
                      "gpu__time_duration.sum", "--page", "raw"], log, arm, a)
            ks = measured(parse_ncu_csv(text, with_grid=a.by_grid))
            if ks:
                break
        if not ks:
            res["arms"][arm] = {"error": f"rc={rc}", "stderr": err, "log_head": text[:2000]}
            print(f"{arm}: no kernels read (rc={rc})\n{err}\n{text[:2000]}", flush=True)
            continue
        s = summarize(ks, a.steps)
        res["arms"][arm] = s
        unit = f"{a.chunk}-token chunk" if a.phase == "prefill" else "decode step"
        print(f"\n{arm}: {s['kernels_per_step']:.0f} kernels, "
              f"{s['busy_us_per_step']:.0f} us busy per {unit} (context {a.context})")
        for name, row in list(s["by_kernel"].items())[:40 if a.by_grid else 25]:
            print(f"  {row['us_per_step']:9.1f} us  {row['launches_per_step']:6.1f} x "
                  f"{row['mean_us']:7.2f} us  {name[:110]}")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "kernel_times.json").write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
