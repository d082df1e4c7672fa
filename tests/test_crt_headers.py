"""``benchmarks/gpu/crt_headers.py``: which wheel it picks for the installed CUDA version
and which header files it writes (fake wheels and a fake site-packages; no download)."""
import importlib.util
import zipfile
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu" / "crt_headers.py"
spec = importlib.util.spec_from_file_location("crt_headers", _PATH)
ch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ch)


def fake_wheel(folder: Path, version: str, files: dict) -> Path:
    w = folder / f"nvidia_cuda_crt-{version}-py3-none-manylinux2014_x86_64.whl"
    with zipfile.ZipFile(w, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
        z.writestr(f"nvidia_cuda_crt-{version}.dist-info/METADATA", "Name: nvidia-cuda-crt\n")
    return w


def test_pick_wheel_by_major_minor(tmp_path):
    ws = [fake_wheel(tmp_path, v, {}) for v in ("13.0.48", "13.0.88", "13.1.115", "13.10.2")]
    assert ch.pick_wheel(ws, "13.0.96") == ws[1]  # newest 13.0
    assert ch.pick_wheel(ws, "13.1.80") == ws[2]
    assert ch.pick_wheel(ws, "13.10.0") == ws[3]  # not confused with 13.1
    assert ch.pick_wheel(ws, "13.2.51") is None
    assert ch.pick_wheel(ws, None) is None
    assert ch.pick_wheel(ws, "garbage") is None


def test_install_writes_missing_files_only(tmp_path):
    site = tmp_path / "site"
    inc = site / "nvidia" / "cu13" / "include"
    (inc / "crt").mkdir(parents=True)
    (inc / "mma.h").write_text('#include "crt/mma.h"\n')
    (inc / "crt" / "host_defines.h").write_text("installed\n")
    (inc / "crt" / "mma.hpp").write_text("installed hpp\n")
    (site / "other" / "nvidia").mkdir(parents=True)  # no mma.h: not a target
    w = fake_wheel(tmp_path, "13.0.88", {
        "nvidia/cu13/include/crt/mma.h": "crt mma\n",
        "nvidia/cu13/include/crt/mma.hpp": "crt mma hpp\n",
        "nvidia/cu13/include/crt/host_defines.h": "from the wheel\n",
        "nvidia/cu13/include/crt/math_functions.h": "not needed by mma.h\n",
        "nvidia/cu13/include/cuda.h": "not crt\n",
    })
    assert ch.include_dirs([site, site / "other", tmp_path / "missing"]) == [inc]
    written = ch.install(w, inc)
    assert written == ["mma.h"]  # mma.hpp exists; other crt/ headers are never written
    assert (inc / "crt" / "mma.h").read_text() == "crt mma\n"
    assert (inc / "crt" / "mma.hpp").read_text() == "installed hpp\n"  # not overwritten
    assert (inc / "crt" / "host_defines.h").read_text() == "installed\n"
    assert not (inc / "crt" / "math_functions.h").exists()
    assert not (inc / "cuda.h").exists()
    assert ch.install(w, inc) == []  # a second run writes nothing


def test_minor_of():
    assert ch.minor_of("13.0.96") == "13.0"
    assert ch.minor_of("13.10") == "13.10"
    assert ch.minor_of("") is None and ch.minor_of(None) is None
