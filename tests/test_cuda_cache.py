"""Ahead-of-time CUDA kernel compilation into MLX's disk cache (mlx_lily.cuda_cache).

CPU: the libstdc++ hash, the source rendering, launch recording through the dispatchers
with a stand-in ``cuda_kernel``, the cache writer. Where an NVRTC library is found
(``MLX_LILY_NVRTC``): every kernel of a production-dims forward compiles for sm_90a.
GPU: the rendering equals what MLX generates, and a kernel served from the written cache
matches its reference in a fresh process.
"""

import os
import subprocess
import sys
import textwrap

import mlx.core as mx
import numpy as np
import pytest

from mlx_lily import backend, cuda_cache, kernels
from mlx_lily.ops import add_rms_norm as arn

# std::hash<std::string> values printed by a g++/libstdc++ program (x86-64).
KNOWN_HASHES = {
    b"": 0x553E93901E462A6E,
    b"a": 0x454DDEE488C1ED6B,
    b"abcdefg": 0xDEEE6830A3AF82AF,
    b"abcdefgh": 0x783DB3E38DB898BB,
    b"abcdefghi": 0xB4EC9257851C8AAF,
    b"custom_kernel_lily_qgemv_bfloat16_t_2048\n\nxyz\xff\x01": 0x5005B6D5429BDD02,
}


def test_hash_matches_libstdcxx_values():
    for data, want in KNOWN_HASHES.items():
        assert cuda_cache.libstdcxx_hash(data) == want, data
    big = bytes((i * 131) % 256 for i in range(100003))
    assert cuda_cache.libstdcxx_hash(big) == 0xD546DAAF67B4D2BE


def test_hash_matches_compiled_std_hash(tmp_path):
    """Against std::hash compiled here, on random strings of every tail length."""
    import shutil

    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++")
    src = tmp_path / "h.cpp"
    src.write_text(textwrap.dedent("""
        #include <functional>
        #include <iostream>
        #include <iterator>
        #include <string>
        int main() {
          std::string s((std::istreambuf_iterator<char>(std::cin)), {});
          std::cout << std::hash<std::string>{}(s) << std::endl;
        }"""))
    exe = tmp_path / "h"
    subprocess.run([gxx, "-O1", str(src), "-o", str(exe)], check=True)
    rng = np.random.default_rng()
    for n in list(range(0, 17)) + [int(rng.integers(100, 5000))]:
        data = rng.integers(0, 256, size=n, dtype=np.uint8).tobytes()
        out = subprocess.run([str(exe)], input=data, capture_output=True, check=True)
        assert cuda_cache.libstdcxx_hash(data) == int(out.stdout), n


def _launch(template=(("T", mx.bfloat16), ("D", 2048), ("E", 8), ("B", True)), ndim=2):
    return cuda_cache.Launch(
        "demo", "// helper\n", "out[0] = x[0]; // x_strides\n", ("x", "w"),
        ((mx.bfloat16, ndim), (mx.float32, 0)), ("out", "aux"), (mx.bfloat16, mx.float32),
        tuple(template))


def test_render_layout():
    src = cuda_cache.render(_launch())
    assert src.startswith('\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include '
                          "<cooperative_groups.h>\n\n// helper\nnamespace mlx::core::cu {")
    assert ("__global__ void custom_kernel_demo_bfloat16_t_2048_8_t(\n"
            "    const __nv_bfloat16* x,\n"
            "    const __grid_constant__ Strides x_strides,\n"
            "    const float* w,\n"
            "    __nv_bfloat16* out,\n"
            "    float* aux) {\n"
            "  using T = __nv_bfloat16;\n  constexpr int D = 2048;\n  constexpr int E = 8;\n"
            "  constexpr bool B = true;\n\n") in src
    assert src.endswith("// x_strides\n\n}\n\n} // namespace mlx::core::cu\n")
    # a 0-d input gets no shape parameters; no template: no constants block
    bare = cuda_cache.render(_launch(template=(), ndim=0))
    assert "x_strides,\n" not in bare and "float* aux) {\nout[0]" in bare


def test_module_name_tracks_source():
    a, b = _launch(), _launch(template=(("T", mx.bfloat16), ("D", 1024), ("E", 8), ("B", True)))
    ma, mb = cuda_cache.module_name(a), cuda_cache.module_name(b)
    assert ma.startswith("custom_kernel_demo_bfloat16_t_2048_8_t_")
    assert ma != mb and cuda_cache.module_name(a) == ma
    assert int(ma.rsplit("_", 1)[1], 16) == cuda_cache.libstdcxx_hash(cuda_cache.render(a))


def test_cache_paths_split_long_names(tmp_path):
    img, txt = cuda_cache.cache_paths(tmp_path, "k" * 600)
    assert img.name == "k" * 110 + ".ptx" and txt.name == "k" * 110 + ".txt"
    assert img.parent == tmp_path / ("k" * 245) / ("k" * 245)


def _stub_cuda_dispatch(monkeypatch):
    """Dispatchers take their CUDA kernel path on this machine; kernels return zeros."""

    def factory(**_):
        def call(*, inputs, output_shapes, output_dtypes, **__):
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

        return call

    monkeypatch.setattr(kernels, "_CACHE", {})
    monkeypatch.setattr(mx.fast, "cuda_kernel", factory)


def test_recording_through_dispatch(monkeypatch):
    _stub_cuda_dispatch(monkeypatch)
    x = mx.random.normal((3, 2048)).astype(mx.bfloat16)
    w = mx.ones((2048,), dtype=mx.bfloat16)
    with backend.tracing_backend("cuda"):
        with cuda_cache.recording() as rec:
            arn.add_rms_norm(x, x, w, 1e-6)
        arn.add_rms_norm(x, x, w, 1e-6)  # not recorded
    assert len(rec) == 1
    ln = rec[0]
    assert ln.name == arn.SPEC.name and ln.input_names == tuple(arn.SPEC.inputs)
    assert ln.inputs[0] == (mx.bfloat16, 2) and ("D", 2048) in ln.template
    assert f"custom_kernel_{arn.SPEC.name}_bfloat16_t_2048_" in cuda_cache.module_name(ln)


class _FakeNvrtc:
    version = (13, 0)

    def __init__(self):
        self.calls = []

    def compile(self, source, name, expression, options, headers=None, sass=True):
        self.calls.append((name, expression, options, headers))
        if "FAIL" in source:
            raise cuda_cache.CompileError(f"{name}: error")
        return b"IMAGE:" + name.encode(), "_Z" + expression.replace("::", "_")


def test_precompile_writes_mlx_cache_files(tmp_path):
    good, bad = _launch(), _launch()._replace(source="FAIL\n")
    nv = _FakeNvrtc()
    rep = cuda_cache.precompile([good, good, bad], directory=tmp_path, arch=(9, 0),
                                include_dirs=["/inc"], nvrtc=nv, workers=2)
    assert rep["kernels"] == 2 and rep["compiled"] == 1 and rep["cached"] == 0
    assert list(rep["failed"]) == [cuda_cache.module_name(bad)]
    mod = cuda_cache.module_name(good)
    img, txt = cuda_cache.cache_paths(tmp_path, mod)
    assert img.read_bytes() == b"IMAGE:" + mod.encode()
    expr = "mlx::core::cu::custom_kernel_demo_bfloat16_t_2048_8_t"
    assert txt.read_text() == f"{expr}\t_Z{expr.replace('::', '_')}\n"
    opts = nv.calls[0][2]
    assert opts[:2] == ["--device-as-default-execution-space", "--gpu-architecture=sm_90a"]
    assert "--include-path=/inc" in opts and cuda_cache.SHIM_NAME in nv.calls[0][3]
    assert not list(tmp_path.glob(".*.tmp"))
    again = cuda_cache.precompile([good], directory=tmp_path, arch=(9, 0), nvrtc=_FakeNvrtc())
    assert again["cached"] == 1 and again["compiled"] == 0


def test_precompile_without_nvrtc_reports_skip(tmp_path, monkeypatch):
    monkeypatch.setattr(cuda_cache, "find_nvrtc", lambda: None)
    rep = cuda_cache.precompile([_launch()], directory=tmp_path, arch=(9, 0))
    assert "NVRTC not found" in rep["skipped"] and rep["compiled"] == 0


def test_precompile_never_raises_for_files(tmp_path):
    """An unusable cache folder is reported, not raised (MLX then compiles at launch)."""
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    rep = cuda_cache.precompile([_launch()], directory=blocker / "cache", arch=(9, 0),
                                nvrtc=_FakeNvrtc())
    assert rep["skipped"] == "no writable kernel cache folder" and rep["compiled"] == 0
    assert str(blocker / "cache") in rep["unwritable"]


def test_precompile_writes_every_folder_mlx_may_read(tmp_path, monkeypatch):
    """MLX reads MLX_PTX_CACHE_DIR once, perhaps before patch() set it: both the variable's
    folder and MLX's temp default get the files; one already holding a module is copied."""
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    for v in ("TMP", "TEMP", "TEMPDIR"):
        monkeypatch.delenv(v, raising=False)
    default = tmp_path / "tmp" / "mlx" / mx.__version__ / "ptx"
    assert cuda_cache.cache_dirs() == [tmp_path / "env", default]
    a, b = _launch(), _launch(template=(("T", mx.float32),))
    rep = cuda_cache.precompile([a], arch=(9, 0), nvrtc=_FakeNvrtc())
    assert rep["compiled"] == 1 and len(rep["directories"]) == 2
    for d in (tmp_path / "env", default):
        img, txt = cuda_cache.cache_paths(d, cuda_cache.module_name(a))
        assert img.read_bytes().startswith(b"IMAGE:") and txt.read_text().endswith("\n")
    # a module only the default folder holds is copied over, not compiled again
    cuda_cache.precompile([b], directory=default, arch=(9, 0), nvrtc=_FakeNvrtc())
    rep = cuda_cache.precompile([a, b], arch=(9, 0), nvrtc=_FakeNvrtc())
    assert rep["cached"] == 2 and rep["compiled"] == 0
    assert cuda_cache.cache_paths(tmp_path / "env", cuda_cache.module_name(b))[0].exists()


def test_warmup_survives_a_failing_precompile(monkeypatch):
    """On CUDA, an error inside the ahead-of-time compile only warns: patch() goes on."""
    import _models

    import mlx_lily
    from mlx_lily import patching

    _stub_cuda_dispatch(monkeypatch)

    def boom(*a, **k):
        raise PermissionError("read-only home")

    monkeypatch.setattr(cuda_cache, "precompile", boom)
    model = _models.build("qwen3_5_moe", seed=5)
    with backend.tracing_backend("cuda"):
        with pytest.warns(UserWarning, match="ahead of time failed"):
            with mlx_lily.patched(model):
                assert mlx_lily.is_patched()
    assert "read-only home" in patching.last_warmup["skipped"]


def _production_launches(monkeypatch, layers=4, kernels_setting="all"):
    """Kernel launches of a production-dims (Qwen3.6-35B-A3B, ``layers`` layers) forward,
    recorded on a lazy model: nothing is evaluated but the fused projections. The decode
    step runs through the compiled layer functions, traced (and so recorded) here first:
    prepare's own warm-up is skipped. ``kernels_setting``: ``MLX_LILY_KERNELS``."""
    import mlx_lily
    from mlx_lily import patching, synth

    _stub_cuda_dispatch(monkeypatch)
    monkeypatch.setattr(patching, "warmup", lambda *a, **k: 0.0)
    monkeypatch.setenv("MLX_LILY_KERNELS", kernels_setting)
    model, _ = synth._lazy_model(synth._text_config(num_hidden_layers=layers))
    model.eval()
    model.set_dtype(mx.bfloat16)
    with backend.tracing_backend("cuda"):
        mlx_lily.patch()
        mlx_lily.prepare_model(model)
        _, launches = cuda_cache.record_forward(model)
    return launches


@pytest.mark.slow
def test_production_forward_records_every_op(monkeypatch):
    """The recorded forward (an 8-token prefill, a decode step, a 2048-token prefill)
    launches every op's kernels. With every kernel on, the decode step's MoE is the one
    fused launch (``moe_fused``) and both prefills' the grouped GEMM (a prefill chunk
    never takes the MoE decode kernels); with ``moe_fused`` off the decode step takes
    ``moe_experts``' gate+up and down kernels."""
    launches = _production_launches(monkeypatch)
    ops = {kernels.op_of(kernels.KernelSpec(l.name, _stem(l.name), (), ())) for l in launches}
    assert ops >= {"add_rms_norm", "attention", "gated_delta", "moe_router_topk",
                   "moe_fused", "moe_route", "moe_grouped", "qgemv"}
    names = {l.name for l in launches}
    assert {"lily_gdn_decode", "lily_moe_decode", "lily_norm_qgemv"} <= names  # decode step
    assert not {"lily_moe_gate_up", "lily_moe_down"} & names
    unfused = _production_launches(monkeypatch, kernels_setting=",".join(
        op for op in backend.OP_NAMES if op != "moe_fused"))
    names_unfused = {l.name for l in unfused}
    assert {"lily_moe_gate_up", "lily_moe_down"} <= names_unfused  # decode step
    assert "lily_moe_decode" not in names_unfused
    packed = {(l.name, dict(l.template).get("PACKED")) for l in launches}
    assert ("lily_gdn_decode", True) in packed and ("lily_attn_qk_norm_rope", True) in packed
    pre = {dict(l.template).get("PRE_NORM") for l in launches if l.name == "lily_moe_router_topk"}
    assert True in pre


def _stem(name):
    for spec in _all_specs():
        if spec.name == name:
            return spec.stem
    raise KeyError(name)


def _all_specs():
    import importlib

    from mlx_lily.ops import _MODULES

    out = []
    for mod in sorted({m.partition(":")[0] for m in _MODULES.values()}):
        m = importlib.import_module(mod)
        out += [v for v in vars(m).values() if isinstance(v, kernels.KernelSpec)]
    return out


@pytest.mark.slow
def test_production_kernels_compile_with_nvrtc(monkeypatch, tmp_path):
    """Every kernel of a production forward compiles under the stand-in header, in two
    worker processes (needs an NVRTC library: MLX_LILY_NVRTC, or MLX's CUDA build)."""
    try:
        cuda_cache.Nvrtc()
    except OSError:
        pytest.skip("no NVRTC library (set MLX_LILY_NVRTC)")
    inc = tmp_path / "inc" / "mlx" / "backend" / "cuda" / "device"
    inc.mkdir(parents=True)
    (inc / "config.h").write_text("#pragma once\n#define MAX_NDIM 10\n#define WARP_SIZE 32\n")
    cuda_inc = [d for d in (os.environ.get("CUDA_HOME", "/usr/local/cuda") + "/include",)
                if os.path.exists(os.path.join(d, "cuda_bf16.h"))]
    if not cuda_inc:
        pytest.skip("no CUDA headers (set CUDA_HOME)")
    dirs = [str(tmp_path / "inc"), cuda_inc[0]]
    if os.path.isdir(os.path.join(cuda_inc[0], "cccl")):
        dirs.append(os.path.join(cuda_inc[0], "cccl"))
    launches = _production_launches(monkeypatch)
    rep = cuda_cache.precompile(launches, directory=tmp_path / "cache", arch=(9, 0),
                                include_dirs=dirs, workers=2)
    assert rep["failed"] == {} and rep["compiled"] == rep["kernels"] >= 15, rep
    assert rep["workers"] == 2
    for p in (tmp_path / "cache").glob("*.ptx"):
        assert p.read_bytes()[:4] == b"\x7fELF"  # a cubin
        assert p.with_suffix(".txt").read_text().startswith("mlx::core::cu::custom_kernel_")


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not backend._cuda_available(), reason="needs MLX's CUDA backend")
def test_render_equals_mlx_generated_source(tmp_path):
    """The source MLX prints with verbose=True is byte for byte ours."""
    D = 2048
    x = mx.random.normal((2, D)).astype(mx.bfloat16)
    w = mx.ones((D,), dtype=mx.bfloat16)
    k = kernels.build(arn.SPEC, "cuda")
    head, body = kernels.cuda_parts(arn.SPEC.stem)
    out_file = tmp_path / "stdout.txt"
    with cuda_cache.recording() as rec:
        kernels.RecordedCudaKernel(k, arn.SPEC)  # construction records nothing
    assert rec == []
    fd = os.dup(1)
    with open(out_file, "w") as f:
        sys.stdout.flush()
        os.dup2(f.fileno(), 1)
        try:
            verbose = kernels.RecordedCudaKernel(lambda **kw: k(verbose=True, **kw), arn.SPEC)
            with cuda_cache.recording() as rec:
                arn.add_rms_norm_fused(x, x, w, 1e-6, kernel=verbose)
        finally:
            os.dup2(fd, 1)
            os.close(fd)
    printed = out_file.read_text()
    start = printed.index("```\n") + 4
    end = printed.index("\n```", start)
    assert len(rec) == 1
    assert printed[start:end] == cuda_cache.render(rec[0])


CHILD = r"""
import json, os, sys
import mlx.core as mx
from mlx_lily import cuda_cache, kernels
from mlx_lily.ops import add_rms_norm as arn
D = 2048
x = mx.random.normal((5, D), key=mx.random.key(1)).astype(mx.bfloat16)
r = mx.random.normal((5, D), key=mx.random.key(2)).astype(mx.bfloat16)
w = mx.random.normal((D,), key=mx.random.key(3)).astype(mx.bfloat16)
k = kernels.get(arn.SPEC, "cuda")
with cuda_cache.recording() as rec:
    h, n = arn.add_rms_norm_fused(x, r, w, 1e-6, kernel=k)
rep = cuda_cache.precompile(rec) if sys.argv[1] == "compile" else {}
mx.eval(h, n)
hr, nr = arn.add_rms_norm_reference(x, r, w, 1e-6)
err = max(float(mx.abs(h.astype(mx.float32) - hr.astype(mx.float32)).max()),
          float(mx.abs(n.astype(mx.float32) - nr.astype(mx.float32)).max()))
print(json.dumps({"report": rep, "err": err, "modules": [cuda_cache.module_name(l) for l in rec]}))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not backend._cuda_available(), reason="needs MLX's CUDA backend")
def test_kernel_served_from_written_cache(tmp_path):
    """Process 1 compiles the kernel into a fresh cache and runs it; process 2 loads it
    from there. Both match the reference."""
    import json

    # a fresh TMPDIR too: precompile also looks in MLX's default cache (<TMPDIR>/mlx/...),
    # which an earlier run (or a restored kernel cache) may already hold this module in
    fresh_tmp = tmp_path / "tmpdir"
    fresh_tmp.mkdir()
    env = dict(os.environ, MLX_PTX_CACHE_DIR=str(tmp_path / "ptx"), MLX_LILY_KERNELS="all")
    for v in ("TMP", "TEMP", "TEMPDIR"):
        env.pop(v, None)
    env["TMPDIR"] = str(fresh_tmp)
    outs = []
    for mode in ("compile", "load"):
        p = subprocess.run([sys.executable, "-c", CHILD, mode], env=env, capture_output=True,
                           text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        outs.append(json.loads(p.stdout.strip().splitlines()[-1]))
    assert outs[0]["report"]["compiled"] == 1, outs[0]
    mod = outs[0]["modules"][0]
    assert outs[1]["modules"] == [mod]
    assert cuda_cache.cache_paths(tmp_path / "ptx", mod)[0].stat().st_size > 0
    for o in outs:
        assert o["err"] <= 0.05, o


def test_device_index_of_gpu_devices_and_cpu(monkeypatch):
    """``device_arch()`` with no index reads the default device's ordinal: MLX's Python
    ``Device`` has no ``index`` attribute (an earlier version read one and failed on
    every GPU machine), so the ordinal comes from its repr."""
    assert cuda_cache.device_index(mx.Device(mx.gpu, 3)) == 3
    assert cuda_cache.device_index(mx.Device(mx.gpu)) == 0
    assert cuda_cache.device_index(mx.Device(mx.cpu)) == 0
    assert cuda_cache.device_index(mx.cpu) == 0
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu, 2))
    seen = []

    class FakeCuda:
        def cuInit(self, flags):
            return 0

        def cuDeviceGet(self, ref, index):
            seen.append(index)
            return 1  # "no such device": device_arch answers None

    monkeypatch.setattr(cuda_cache.ctypes, "CDLL", lambda name: FakeCuda())
    assert cuda_cache.device_arch() is None
    assert seen == [2]


def _stubbed_cuda_model(monkeypatch, **env):
    """A lazy 4-layer model at production dims for the CUDA path with stubbed kernels
    (every kernel allowed, compiled decode steps on, no warm-up), ``env`` set."""
    from mlx_lily import patching, synth

    _stub_cuda_dispatch(monkeypatch)
    monkeypatch.setattr(patching, "warmup", lambda *a, **k: 0.0)
    monkeypatch.setenv("MLX_LILY_KERNELS", "all")
    monkeypatch.setenv("MLX_LILY_COMPILE", "1")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    model, _ = synth._lazy_model(synth._text_config(num_hidden_layers=4))
    model.eval()
    model.set_dtype(mx.bfloat16)
    return model


@pytest.mark.parametrize("whole", ["1", "0"])
def test_compiled_attention_decode_steps_plumbing(monkeypatch, whole):
    """Compiled decode steps on the CUDA path (kernels stubbed, nothing evaluated,
    production dims, 4 layers): attention layers' decode steps run compiled over the whole
    cache buffers (DYN_T launches), the offset advances each step, a full cache grows
    through the eager path once and the compiled step then retraces at the new capacity.
    With ``MLX_LILY_COMPILE_WHOLE`` on (default) the whole stack is one compiled function
    (``steps["whole"]``); off, each layer has its own."""
    import mlx_lily
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    model = _stubbed_cuda_model(monkeypatch, MLX_LILY_COMPILE_ATTN="1",
                                MLX_LILY_COMPILE_WHOLE=whole)
    inner = model.language_model.model
    with backend.tracing_backend("cuda"):
        with mlx_lily.patched(model):
            cache = make_prompt_cache(model)
            model(mx.array([[5]]), cache=cache)  # fills every cache eagerly
            ai = [i for i, l in enumerate(inner.layers) if not l.is_linear][0]
            c = cache[ai]
            assert type(c) is KVCache
            c.keys, c.values = c.keys[..., :8, :], c.values[..., :8, :]  # capacity 8
            c.offset = 6
            with cuda_cache.recording() as rec:
                fns = []
                for _ in range(4):  # offsets 6, 7 compiled; 8 grows (eager); 9 compiled
                    model(mx.array([[5]]), cache=cache)
                    fns.append(inner._lily_steps.whole)
            cs = inner._lily_steps
            steps = cs.fns
    assert c.offset == 10 and c.keys.shape[2] == 8 + c.step
    per_layer_attn = any(len(k) == 3 and k[0] == ai and callable(f) for k, f in steps.items())
    if whole == "1":
        assert callable(cs.whole[1]) and not per_layer_attn
        # one compiled function per cache capacity: a new one after the growth
        assert fns[0][1] is fns[1][1] and fns[3][1] is not fns[1][1] and fns[3][0] != fns[1][0]
    else:
        assert cs.whole is None and per_layer_attn
    dyn = [dict(l.template).get("DYN_T") for l in rec if l.name == "lily_attn_decode_partial"]
    assert True in dyn and False in dyn  # compiled steps, and the growing step's eager one


def test_whole_steps_kept_per_capacity(monkeypatch):
    """Two caches of different capacities decoded in turn (two requests of different
    lengths): each capacity's compiled whole-stack step is traced once and reused
    (``RECENT_WHOLE_STEPS`` kept), not traced again at every switch; the oldest goes
    beyond that."""
    import mlx_lily
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lily.patches import qwen3_next as P

    model = _stubbed_cuda_model(monkeypatch, MLX_LILY_KV_STEP="256")
    inner = model.language_model.model
    compiles = []
    real = P.mx.compile

    def counting(fn, *a, **k):
        if "_whole_step_fn" in getattr(fn, "__qualname__", ""):
            compiles.append(fn)
        return real(fn, *a, **k)

    with backend.tracing_backend("cuda"):
        with mlx_lily.patched(model):
            monkeypatch.setattr(P.mx, "compile", counting)
            caches = []
            for n in (3, 260, 520, 780, 1040, 1300):  # capacities 256, 512, .., 1536
                c = make_prompt_cache(model)
                model(mx.array([[5] * n]), cache=c)  # prefill: fills and sizes the cache
                caches.append(c)
            for c in caches[:2] * 2:  # capacities 256, 512, 256, 512
                model(mx.array([[5]]), cache=c)
            cs = inner._lily_steps
            assert len(compiles) == 2 and len(cs.recent) == 2
            for c in caches:  # six capacities: the first two are dropped at the 5th, 6th
                model(mx.array([[5]]), cache=c)
            assert len(cs.recent) == P.RECENT_WHOLE_STEPS
            n_after = len(compiles)
            model(mx.array([[5]]), cache=caches[0])  # evicted: traced again
            assert len(compiles) == n_after + 1


def test_strip_source_keeps_code_and_literals():
    """``kernels.strip_source`` (what ``mx.fast.cuda_kernel`` gets: MLX hashes it at every
    launch): comments, indentation and blank lines go; string and character literals,
    preprocessor lines and line structure stay; every CUDA shader shrinks."""
    text = ('// head comment\n#pragma unroll\n  int a = 1; // tail\n\n'
            '  const char* s = "x // not a comment /* nor this */";\n'
            "  char c = '/'; /* block\n comment */ int b = 2;\n"
            '  asm("mov.u64 %0, %%globaltimer;\\n" : "=l"(t));\n')
    out = kernels.strip_source(text)
    assert out.splitlines() == [
        "#pragma unroll", "int a = 1;",
        'const char* s = "x // not a comment /* nor this */";',
        "char c = '/';", "int b = 2;",
        'asm("mov.u64 %0, %%globaltimer;\\n" : "=l"(t));']
    import glob
    import os

    for f in glob.glob(str(kernels._REPO_SHADERS / "cuda" / "*.cu")):
        stem = os.path.basename(f)[:-3]
        head, body = kernels.split_header(kernels.shader_source("cuda", stem + ".cu"))
        sh, sb = kernels.cuda_parts(stem)
        assert len(sh) + len(sb) < len(head) + len(body), stem
        assert "// ----" not in sb and "@header" not in sh, stem


def test_squeeze_spaces_keeps_tokens_apart():
    """``kernels.squeeze_spaces``: blanks between word characters, and between operator
    characters that would join (``- -``, ``/ *``, ``> >``), stay; literals and
    preprocessor lines are untouched; the rest go."""
    text = ('#define X (a + b)\n'
            'template <typename T> __device__ float f(const T* p, int n) {\n'
            'return a - -b + x / *p + y & &z + c ? d : e;\n'
            'asm("ld.global.b32 %0, [%1];" : "=r"(v) : "l"(p));\n'
            "char c = ' '; unsigned long long u = 1ull << 3; A<B<int> > q;\n")
    assert kernels.squeeze_spaces(text).splitlines() == [
        "#define X (a + b)",
        "template<typename T>__device__ float f(const T*p,int n){",
        "return a- -b+x/ *p+y& &z+c?d:e;",
        'asm("ld.global.b32 %0, [%1];":"=r"(v):"l"(p));',
        "char c=' ';unsigned long long u=1ull<<3;A<B<int> >q;"]


def test_prune_header_drops_only_unused_helpers():
    """``kernels.prune_header``: a helper survives when the body or a surviving helper
    names it (transitively); structs, templates, variables and preprocessor blocks are
    recognised; an item it cannot name is kept."""
    head = kernels.strip_source(
        "template <typename T>\n__device__ float used(T v) { return helper(v); }\n"
        "__device__ float helper(float v) { return v; }\n"
        "__device__ float unused(float v) {\n  return v;\n}\n"
        "template <int N>\nstruct Tile {\n  float q[N];\n};\n"
        "struct Other { int a; };\n"
        "constexpr int kTab[2] = {1, 2};\n"
        "constexpr int kDead = 3;\n"
        "#ifdef LILY_EMU\n__device__ int emu_only() { return 0; }\n#endif\n"
        "#define LILY_X 1\n")
    body = "Tile<4> t; float y = used(t.q[0]) + kTab[1];\n"
    out = kernels.prune_header(head, body)
    for kept in ("used(", "helper(", "struct Tile", "kTab", "emu_only", "#define LILY_X"):
        assert kept in out, kept
    for gone in ("unused", "struct Other", "kDead"):
        assert gone not in out, gone
    assert kernels.prune_header(head, body + "unused(1.f); Other o;\n") == \
        head.replace("constexpr int kDead = 3;\n", "")


@pytest.mark.parametrize("head,body", [
    ("enum Mode { kA, kB };\n", "int m = kA;\n"),
    ("struct __align__(16) P { float x; };\n", "P p;\n"),
    ("__device__ decltype(auto) f(int a) { return a; }\n", "f(1);\n"),
    ("struct Pair { int a; };\n__device__ struct Pair mk() { Pair p; return p; }\n", "mk();\n"),
    ("struct V { int a; };\n__device__ bool operator==(V a, V b) { return a.a == b.a; }\n",
     "V x, y; bool e = x == y;\n"),
    ("struct X { int a; } g;\n", "g.a = 1;\n"),
    ("typedef float (*Fn)(float);\n", "Fn f;\n"),
    ("#define LILY_DEF(n) __device__ int n() { return 1; }\nLILY_DEF(foo)\n", "foo();\n"),
    ('static_assert(sizeof(int) == 4, "x");\n', "int a;\n"),
    ("template <int N>\n#ifdef LILY_EMU\n__device__ int a() { return N; }\n#else\n"
     "__device__ int a() { return 2 * N; }\n#endif\n__device__ int b() { return 1; }\n", "b();\n"),
])
def test_prune_header_keeps_what_it_cannot_name(head, body):
    """Shapes ``prune_header`` does not name (enums, attributes, operators, typedefs,
    macro-made definitions, a declarator after a struct, ``static_assert``, a conditional
    inside an item) are kept whole, used or not."""
    h = kernels.strip_source(head)
    assert kernels.prune_header(h, body) == h


@pytest.mark.parametrize("src,want", [
    ("x = 0xE - 1;\n", "x=0xE -1;\n"),
    ("y = 1e - 3;\n", "y=1e -3;\n"),
    ('auto s = "a" SFX;\n', 'auto s="a" SFX;\n'),
    ('auto w = L "x";\n', 'auto w=L "x";\n'),
])
def test_squeeze_spaces_keeps_literal_boundaries(src, want):
    """No pp-number swallows a sign (``0xE-1`` would be one token) and no literal gains a
    prefix or suffix."""
    assert kernels.squeeze_spaces(src) == want


def test_compiled_decode_honours_attn_packed_switch(monkeypatch):
    """``MLX_LILY_DISABLE=attn_packed`` keeps the packed attention kernels out of the
    compiled decode step too (CUDA path, kernels stubbed): no whole-stack step, no
    packed q/k norm + RoPE launch."""
    import mlx_lily
    from mlx_lm.models.cache import make_prompt_cache

    model = _stubbed_cuda_model(monkeypatch, MLX_LILY_DISABLE="attn_packed")
    inner = model.language_model.model
    with backend.tracing_backend("cuda"):
        with mlx_lily.patched(model):
            cache = make_prompt_cache(model)
            model(mx.array([[5]]), cache=cache)
            with cuda_cache.recording() as rec:
                for _ in range(2):
                    model(mx.array([[5]]), cache=cache)
            cs = inner._lily_steps
    assert cs.whole is None
    assert not any(len(k) == 3 for k in cs.fns)
    packed = [dict(l.template).get("PACKED") for l in rec if l.name == "lily_attn_qk_norm_rope"]
    assert packed and not any(packed)


def test_decode_prefetch_setting_reaches_compiled_steps(monkeypatch):
    """``MLX_LILY_DECODE_PF`` is part of the compiled decode steps' key: changing it between
    steps retraces, and the new trace launches the decode partial kernel with the new
    ``PF`` (kernels stubbed, production dims, 4 layers)."""
    import mlx_lily
    from mlx_lily.ops import attention as A
    from mlx_lm.models.cache import make_prompt_cache

    model = _stubbed_cuda_model(monkeypatch)
    seen = []
    with backend.tracing_backend("cuda"):
        with mlx_lily.patched(model):
            cache = make_prompt_cache(model)
            model(mx.array([[5]]), cache=cache)
            for pf in ("1", "2"):
                monkeypatch.setenv(A.DECODE_PF_ENV, pf)
                with cuda_cache.recording() as rec:
                    model(mx.array([[5]]), cache=cache)
                seen.append({dict(l.template)["PF"] for l in rec
                             if l.name == "lily_attn_decode_partial"})
    assert seen == [{1}, {2}]
