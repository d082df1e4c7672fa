"""The ncu output parsing of ``benchmarks/gpu/kernel_times.py`` (the profiling itself
needs Nsight Compute on a GPU machine)."""
import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "kernel_times.py"
spec = importlib.util.spec_from_file_location("kernel_times", _PATH)
kt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kt)

SAMPLE = '''==PROF== Connected to process 4242 (/usr/bin/python3)
==PROF== Profiling "custom_kernel_lily_qgemv_bf16": 0%....50%....100% - 1 pass
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","gpu__time_duration.sum"
"","","","","","","","","","","","nsecond"
"0","4242","python3","h","custom_kernel_lily_qgemv_bf16_2048","1","7","(128, 1, 1)","(512, 1, 1)","0","9.0","4,512"
"1","4242","python3","h","void mlx::core::cu::gather_qmv<float, 4>(const float*, int)","1","7","(128, 1, 1)","(64, 1, 1)","0","9.0","1,000"
"2","4242","python3","h","custom_kernel_lily_qgemv_bf16_2048","1","7","(128, 1, 1)","(512, 1, 1)","0","9.0","3,488"
"3","4242","python3","h","void mlx::core::cu::gather_qmv<float, 4>(const float*, int)","1","7","(128, 1, 1)","(64, 1, 1)","0","9.0","3000"
'''


def test_parse_and_summarize():
    ks = kt.parse_ncu_csv(SAMPLE)
    assert ks == [("custom_kernel_lily_qgemv_bf16_2048", 4512.0),
                  ("void mlx::core::cu::gather_qmv<float, 4>(const float*, int)", 1000.0),
                  ("custom_kernel_lily_qgemv_bf16_2048", 3488.0),
                  ("void mlx::core::cu::gather_qmv<float, 4>(const float*, int)", 3000.0)]
    s = kt.summarize(ks, steps=2)
    assert s["kernels_per_step"] == 2 and s["busy_us_per_step"] == pytest.approx(6.0)
    first, second = list(s["by_kernel"].items())
    assert first[0] == "custom_kernel_lily_qgemv_bf16_2048"
    assert first[1] == {"launches_per_step": 1.0, "us_per_step": 4.0, "mean_us": 4.0}
    assert second[0] == "void mlx::core::cu::gather_qmv"
    assert second[1]["us_per_step"] == pytest.approx(2.0)


def test_parse_by_grid_keeps_shapes_apart():
    ks = kt.parse_ncu_csv(SAMPLE, with_grid=True)
    assert ks[0] == ("custom_kernel_lily_qgemv_bf16_2048" + kt.GRID_SEP + "(512, 1, 1)", 4512.0)
    s = kt.summarize(ks, steps=2)
    assert list(s["by_kernel"]) == ["custom_kernel_lily_qgemv_bf16_2048 grid(512, 1, 1)",
                                    "void mlx::core::cu::gather_qmv grid(64, 1, 1)"]
    no_col = "\n".join(l.replace(',"Grid Size"', "") if l.startswith('"ID"') else l
                       for l in SAMPLE.splitlines())
    assert kt.parse_ncu_csv(no_col, with_grid=True)[0][0].startswith("custom_kernel")


def test_parse_without_table_is_empty():
    assert kt.parse_ncu_csv("==ERROR== the profiler failed\n") == []


def test_measured_rows_between_markers():
    rows = [("a", 1.0), ("x_lily_ncu_mark_begin_1", 0.1), ("b", 2.0), ("c", 3.0),
            ("x_lily_ncu_mark_end_1", 0.1), ("d", 4.0)]
    assert kt.measured(rows) == [("b", 2.0), ("c", 3.0)]
    assert kt.measured([("a", 1.0), ("b", 2.0)]) == [("a", 1.0), ("b", 2.0)]


DETAILS = '''==PROF== Disconnected from process 7
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","7","python3","h","custom_kernel_lily_norm_qgemv_bf16","1","7","(128, 1, 1)","(772, 1, 1)","0","9.0","Launch Statistics","Registers Per Thread","register/thread","96"
"0","7","python3","h","custom_kernel_lily_norm_qgemv_bf16","1","7","(128, 1, 1)","(772, 1, 1)","0","9.0","Occupancy","Achieved Occupancy","%","41.5"
"1","7","python3","h","custom_kernel_lily_norm_qgemv_bf16","1","7","(64, 1, 1)","(129, 1, 1)","0","9.0","Launch Statistics","Registers Per Thread","register/thread","72"
"1","7","python3","h","custom_kernel_lily_norm_qgemv_bf16","1","7","(64, 1, 1)","(129, 1, 1)","0","9.0","Occupancy","","",""
'''


def test_parse_details_per_launch():
    ls = kt.parse_ncu_details(DETAILS)
    assert [e["id"] for e in ls] == ["0", "1"]
    assert ls[0]["grid"] == "(772, 1, 1)" and ls[1]["block"] == "(64, 1, 1)"
    assert ls[0]["metrics"] == {
        "Launch Statistics / Registers Per Thread": "96 register/thread",
        "Occupancy / Achieved Occupancy": "41.5 %"}
    assert ls[1]["metrics"] == {"Launch Statistics / Registers Per Thread": "72 register/thread"}
    assert kt.parse_ncu_details("no table\n") == []


RAW = '''==PROF== Connected to process 7 (/usr/bin/python3)
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","launch__registers_per_thread","smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio","sm__throughput.avg.pct_of_peak_sustained_elapsed"
"","","","","","","","","","","","register/thread","","%"
"0","7","python3","h","custom_kernel_lily_moe_down(const __nv_bfloat16 *, unsigned int *)","1","7","(384, 1, 1)","(128, 1, 1)","0","9.0","128","12.5","31.2"
"1","7","python3","h","custom_kernel_lily_moe_down(const __nv_bfloat16 *, unsigned int *)","1","7","(384, 1, 1)","(128, 1, 1)","0","9.0","128","11.9","30.8"
'''


def test_parse_raw_page_per_launch():
    """``--detail`` reads ncu's raw page: every metric column per launch, with units."""
    ls = kt.parse_ncu_raw(RAW)
    assert [l["id"] for l in ls] == ["0", "1"]
    assert ls[0]["name"].startswith("custom_kernel_lily_moe_down(") and ls[0]["grid"] == "(128, 1, 1)"
    assert ls[0]["block"] == "(384, 1, 1)"
    m = ls[1]["metrics"]
    assert m == {"launch__registers_per_thread": "128 register/thread",
                 "smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio": "11.9",
                 "sm__throughput.avg.pct_of_peak_sustained_elapsed": "30.8 %"}
    assert kt.parse_ncu_raw("no table here") == []


def test_batch_of_merges_copies_into_unpadded_batch_caches():
    """``--batch``: copies of one context merged into mlx-lm's batch caches, no row
    left-padded; a decode step on them gives each row the logits of the context alone
    (stock mlx-lm, CPU)."""
    import mlx.core as mx
    from mlx_lm.models.cache import ArraysCache, BatchKVCache, make_prompt_cache

    import _models
    from mlx_lily.bench.ab import copy_cache

    model = _models.build("qwen3_5_moe", seed=2)
    ids = mx.array([[3, 17, 5, 9, 11, 2, 8]])
    ctx = make_prompt_cache(model)
    model(ids, cache=ctx)
    mx.eval([c.state for c in ctx])
    alone = model(mx.array([[4]]), cache=kt.batch_of(ctx, 1, copy_cache))
    cache = kt.batch_of(ctx, 3, copy_cache)
    kinds = {type(c) for c in cache}
    assert kinds <= {BatchKVCache, ArraysCache} and BatchKVCache in kinds
    for c in cache:
        if isinstance(c, BatchKVCache):
            assert c.left_padding.tolist() == [0, 0, 0] and c._idx == 7
    got = model(mx.array([[4]] * 3), cache=cache)
    assert got.shape[0] == 3
    for b in range(3):
        assert mx.allclose(got[b], alone[0], atol=1e-5).item()


def test_timeout_kills_the_profiled_child(tmp_path, monkeypatch):
    """A timed-out ncu run takes its child with it: a fake ``ncu`` that starts a
    long-lived child and waits must leave no process of that group behind."""
    import os
    import time

    pidfile = tmp_path / "child.pid"
    fake = tmp_path / "ncu"
    fake.write_text(f"#!/bin/sh\nsleep 300 &\necho $! > {pidfile}\nwait\n")
    fake.chmod(0o755)

    class A:
        preset, layers, context, steps, warmup = "tiny", 0, 8, 1, 0
        phase, chunk, batch, timeout_s = "decode", 8, 1, 1.0

    t0 = time.monotonic()
    rc, _, text = kt._run_ncu(str(fake), [], tmp_path / "log.csv", "lily", A)
    assert rc == "timeout" and text == "" and time.monotonic() - t0 < 30
    pid = int(pidfile.read_text())
    for _ in range(50):  # the kill is asynchronous: wait for the child to be gone
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the profiled child {pid} outlived its timeout")
