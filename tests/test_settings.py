"""Settings (``mlx_lily.config``), benchmarking knobs (``mlx_lily.tuning``) and the op
registry (``mlx_lily.registry``): one rule for a bad value, keyword settings of
``patch(...)``, and every list of ops derived from one table."""

import re
import warnings
from pathlib import Path

import pytest

import mlx_lily
from mlx_lily import backend, config, kernels, registry, tuning

ROOT = Path(__file__).resolve().parent.parent

BAD_SETTINGS = {
    "kernels": "bogus",
    "disable": "bogus",
    "compile": "yes",
    "cache_dir": None,  # a file, set by the test
    "precompile": "maybe",
    "prefill_step": "many",
    "qualify": "maybe",
    "prefix_cache": "off",
    "hook": "yes",
}
BAD_KNOBS = {
    "compile_whole": "no",
    "compile_attn": "off",
    "whole_replay": "no",
    "nvrtc": "/nonexistent/libnvrtc.so",
    "gdn_scan": "8,1",
    "prefill_eval_layers": "four",
    "moe_tile_rows": "48",
    "gdn_prefill": "fast",
    "norm_gemv": "maybe",
    "kv_step": "0",
    "gdn_proj_split": "17",
    "gdn_batch_fold": "9",
    "moe_fused_rpw": "2,4",
    "decode_pf": "3",
    "prefix_cache_every": "lots",
    "prefix_cache_snapshots": "-1",
    "step_aside": "maybe",
    "qualify_emulate": "2",
    "inject_fault": None,  # raw text: mlx_lily.first_contact parses it (tests only)
    "attn_decode": "fast",
    "attn_fixed_block": "300",
    "attn_decode_warps": "0",
    "moe_down_shape": "8,2,9",  # each in range, 2304 threads
    "moeg_load": "wide",
    "gdn_scan_load": "shared",
    "qgemv_shape": "4,9",  # RPW over 8
    "qgemv_bpl": "4",
    "qgemv_mma": "fast",
    "gdn_packed_outp": "sometimes",
    "cuda_source": "embedded",
}


def _named(got, env):
    return [w for w in got if f"{env}=" in str(w.message)]


def _check_bad(monkeypatch, s, raw, read):
    monkeypatch.setenv(s.env, raw)
    config.WARNED.discard((s.env, raw))
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        first = read()
        second = read()
    named = _named(got, s.env)
    assert len(named) == 1, [str(w.message) for w in got]
    assert s.accepted in str(named[0].message)
    assert first == s.default and second == s.default


def test_tables_cover_the_same_settings():
    assert set(BAD_SETTINGS) == set(config.SETTINGS)
    assert set(BAD_KNOBS) == set(tuning.KNOBS)
    envs = [s.env for s in (*config.SETTINGS.values(), *tuning.KNOBS.values())]
    assert len(envs) == len(set(envs))
    assert not set(config.SETTINGS) & set(tuning.KNOBS)  # one env_frozen cache holds both


@pytest.mark.parametrize("attr", sorted(BAD_SETTINGS))
def test_bad_user_setting_warns_once_and_uses_default(monkeypatch, tmp_path, attr):
    raw = BAD_SETTINGS[attr]
    if raw is None:
        raw = str(tmp_path / "a-file")
        Path(raw).write_text("")
    _check_bad(monkeypatch, config.SETTINGS[attr], raw, lambda: getattr(config, attr))


@pytest.mark.parametrize("attr", sorted(BAD_KNOBS))
def test_bad_knob_warns_once_and_uses_default(monkeypatch, attr):
    if BAD_KNOBS[attr] is None:
        pytest.skip(f"{attr}: passed on as text, parsed by the test tooling that reads it")
    _check_bad(monkeypatch, tuning.KNOBS[attr], BAD_KNOBS[attr], lambda: getattr(tuning, attr))


def test_good_values_parse(monkeypatch, tmp_path):
    for env, raw, attr, want in (
            ("MLX_LILY_KERNELS", "qgemv, attention", "kernels", {"qgemv", "attention"}),
            ("MLX_LILY_DISABLE", "all", "disable", {"all", *registry.NAMES}),
            ("MLX_LILY_COMPILE", "0", "compile", False),
            ("MLX_LILY_CACHE_DIR", str(tmp_path), "cache_dir", tmp_path),
            ("MLX_LILY_PRECOMPILE", "0", "precompile", False),
            ("MLX_LILY_PREFILL_STEP", "-3", "prefill_step", 0)):
        monkeypatch.setenv(env, raw)
        assert getattr(config, attr) == want, env
    for env, raw, attr, want in (("MLX_LILY_GDN_SCAN", "16,2,4", "gdn_scan", (16, 2, 4)),
                                 ("MLX_LILY_MOE_TILE_ROWS", "64", "moe_tile_rows", 64),
                                 ("MLX_LILY_KV_STEP", "256", "kv_step", 256),
                                 ("MLX_LILY_COMPILE_WHOLE", "0", "compile_whole", False)):
        monkeypatch.setenv(env, raw)
        assert getattr(tuning, attr) == want, env
    monkeypatch.setenv("MLX_LILY_KV_STEP", "")
    assert tuning.kv_step is None


def test_partly_unknown_list_keeps_known_names(monkeypatch):
    monkeypatch.setenv("MLX_LILY_DISABLE", "qgemv,nope")
    config.WARNED.discard(("MLX_LILY_DISABLE", "qgemv,nope"))
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        assert config.disable == {"qgemv"}
        assert not backend.op_enabled("qgemv") and backend.op_enabled("attention")
    named = _named(got, "MLX_LILY_DISABLE")
    assert len(named) == 1 and "nope" in str(named[0].message)


def test_settings_follow_env_frozen(monkeypatch):
    monkeypatch.setenv("MLX_LILY_KV_STEP", "512")
    with config.env_frozen():
        assert tuning.kv_step == 512
        monkeypatch.setenv("MLX_LILY_KV_STEP", "1024")
        assert tuning.kv_step == 512
    assert tuning.kv_step == 1024


def test_patch_keyword_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_LILY_KERNELS", "all")
    monkeypatch.setenv("MLX_LILY_DISABLE", "qgemv")
    with mlx_lily.patched(kernels=["qgemv"], disable=(), compile=False,
                          cache_dir=tmp_path, prefill_step=64):
        assert config.kernels == {"qgemv"} and config.disable == frozenset()
        assert backend.op_enabled("qgemv")
        assert kernels.kernels_allowed("qgemv", "cuda")
        assert not kernels.kernels_allowed("attention", "cuda")
        assert backend.compile_mode("cuda") == "off"
        assert config.cache_dir == tmp_path and config.prefill_step == 64
        current = config.current()
        assert current.kernels == {"qgemv"} and current.compile is False
    assert config.kernels == {"all"} and config.disable == {"qgemv"}
    assert config.compile is None and config.overrides() == {}


@pytest.mark.parametrize("kw", [{"kernels": "nope"}, {"compile": "sometimes"},
                                {"prefill_step": "x"}, {"colour": "red"}, {"hook": True}])
def test_patch_bad_keyword_raises_and_leaves_nothing(kw):
    with pytest.raises(ValueError, match="mlx-lily: patch"):
        mlx_lily.patch(**kw)
    assert not mlx_lily.is_patched() and config.overrides() == {}


def test_runtime_reads_settings_only_through_config():
    """No runtime module reads an ``MLX_LILY_*`` variable itself: ``config`` and ``tuning``
    are the only readers (the dev tools under ``mlx_lily/testing`` and ``mlx_lily/bench``
    have their own)."""
    files = [*ROOT.glob("mlx_lily/*.py"), *ROOT.glob("mlx_lily/ops/*.py"),
             *ROOT.glob("mlx_lily/patches/*.py"), *ROOT.glob("patches/*.py")]
    assert files
    offenders = []
    for f in files:
        if f.name in ("config.py", "tuning.py"):
            continue
        text = f.read_text()
        for m in re.finditer(r"(os\.environ(\.get)?[\[(]\s*[\"']MLX_LILY|env_value\()", text):
            line = text[: m.start()].count("\n") + 1
            offenders.append(f"{f.relative_to(ROOT)}:{line}")
    assert offenders == []
    envs = {s.env for s in (*config.SETTINGS.values(), *tuning.KNOBS.values())}
    used = set()
    for f in files:
        used |= set(re.findall(r"MLX_LILY_[A-Z0-9_]+", f.read_text()))
    assert used <= envs | {"MLX_LILY_"}, sorted(used - envs)


def test_tuning_doc_lists_every_knob():
    doc = ROOT / "docs" / "tuning.md"
    if not doc.exists():
        pytest.skip("docs/tuning.md is not in this tree")
    text = doc.read_text()
    missing = [k.env for k in tuning.KNOBS.values() if not re.search(rf"\b{k.env}\b", text)]
    assert missing == []


def test_readme_settings_table_lists_user_settings_only():
    """The README's settings section names every user setting of ``config`` (the hook
    ``MLX_LILY`` may be described elsewhere) and none of the benchmarking knobs."""
    text = (ROOT / "README.md").read_text()
    m = re.search(r"^## Settings\b.*?(?=^## |\Z)", text, flags=re.M | re.S)
    if m is None:
        pytest.skip("README.md has no '## Settings' section")
    section = m.group(0)

    def named(env):
        return re.search(rf"\b{env}\b", section) is not None

    missing = [s.env for s in config.SETTINGS.values() if s.attr != "hook" and not named(s.env)]
    knobs = [k.env for k in tuning.KNOBS.values() if named(k.env)]
    assert missing == [] and knobs == []


# ---------------------------------------------------------------- registry


def test_registry_is_the_source_of_every_op_list():
    from mlx_lily import ops

    assert backend.OP_NAMES == registry.NAMES
    assert list(ops._MODULES) == list(registry.NAMES)
    for be in ("metal", "cuda"):
        assert kernels.VERIFIED[be] == {op.name for op in registry.OPS if be in op.verified}
    assert {op for _, op in kernels._STEM_OPS} <= set(registry.NAMES)


def test_registry_entries_resolve():
    import importlib

    stems = {p.stem for d in ("metal", "cuda") for p in (ROOT / "shaders" / d).iterdir()
             if p.suffix in (".metal", ".cu")}
    for op in registry.OPS:
        assert op.kind in ("op", "fusion"), op.name
        mod = importlib.import_module(f"mlx_lily.ops.{op.module}")
        assert callable(getattr(mod, op.status)), op.name
        assert set(op.requires) <= set(registry.NAMES), op.name
        assert set(op.verified) <= set(op.backends) <= {"metal", "cuda"}, op.name
        for stem in op.stems:
            assert any(s.startswith(stem) for s in stems), (op.name, stem)
        assert op.doc, op.name
    owner = {s: kernels.op_of(kernels.KernelSpec("n", s, (), ())) for s in stems}
    assert None not in owner.values(), [s for s, o in owner.items() if o is None]
    assert owner["norm_qgemv"] == "norm_qgemv" and owner["moeg_route_rank"] == "moe_route"
    assert owner["moe_decode"] == "moe_fused" and owner["moeg_down"] == "moe_grouped"


def test_why_not_reasons(monkeypatch):
    monkeypatch.setenv("MLX_LILY_KERNELS", "verified")
    monkeypatch.delenv("MLX_LILY_DISABLE", raising=False)
    assert registry.why_not("qgemv", "cpu") == "no cpu kernel"
    assert registry.why_not("moe_fused", "metal") == "no metal kernel"
    assert registry.why_not("attention", "metal").startswith("not verified on metal")
    monkeypatch.setenv("MLX_LILY_KERNELS", "attention")
    assert registry.why_not("qgemv", "metal") == "not listed in MLX_LILY_KERNELS"
    monkeypatch.setenv("MLX_LILY_KERNELS", "all")
    monkeypatch.setenv("MLX_LILY_DISABLE", "qgemv")
    assert registry.why_not("qgemv", "cuda") == "disabled by MLX_LILY_DISABLE"
    assert registry.why_not("qgemv_out", "cuda") == "needs qgemv (disabled by MLX_LILY_DISABLE)"
    with backend.tracing_backend("metal"):
        assert registry.why_not("gdn_proj") == "needs norm_qgemv (needs qgemv (disabled by MLX_LILY_DISABLE))"
    with pytest.raises(ValueError, match="unknown mlx-lily op"):
        registry.why_not("nope", "cuda")
    monkeypatch.delenv("MLX_LILY_DISABLE")
    with mlx_lily.patched(ops=["attention"]):
        assert registry.why_not("qgemv", "cuda") == "left out by patch(ops=...)"
    with backend.tracing_backend("metal"):
        assert registry.why_not("add_rms_norm") is None
        assert registry.why_not("add_rms_norm", call_reason="head_dim") == "head_dim"
        monkeypatch.setenv("MLX_LILY_NORM_GEMV", "split")
        assert registry.why_not("gdn_proj") == "MLX_LILY_NORM_GEMV=split"
        info = backend.backend_info()
    assert info["ops"]["add_rms_norm"] == "kernel" and "add_rms_norm" not in info["reasons"]
    assert info["ops"]["gdn_proj"] == "reference"
    assert info["reasons"]["moe_fused"] == "no metal kernel"


def test_ops_do_not_import_integration_modules():
    """Nothing under ``mlx_lily/ops`` imports the integration modules (``qproj``,
    ``patching``, ``patches``): they import the ops, never the reverse."""
    bad = re.compile(r"^\s*(from|import)\s+(\.\.qproj|mlx_lily\.qproj|\.\.patch|"
                     r"mlx_lily\.patch)", re.M)
    hits = [f.name for f in (ROOT / "mlx_lily" / "ops").glob("*.py") if bad.search(f.read_text())]
    assert hits == []
