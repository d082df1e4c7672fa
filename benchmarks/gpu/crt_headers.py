"""CUDA's ``crt/`` headers for MLX's own kernel JIT on the lent GPU machine.

MLX's CUDA build JIT-compiles some of its own kernels (``qmm_sm90_*``, the quantized GEMM
the shared expert and the test references run at small row counts) against
``nvidia/cu13/include/mma.h``, which includes ``crt/mma.h``. The lent machine's Python has
``nvidia-cuda-runtime`` (``mma.h``) but not ``nvidia-cuda-crt`` (``crt/``), so those
compiles fail and the tests that reach them are skipped (``tests/conftest.py``). This
script carries the ``crt/`` headers there, since that machine reaches no registry:

    python3 benchmarks/gpu/crt_headers.py prepare .devcache/crt     # here: one wheel per 13.x
    python3 benchmarks/gpu/crt_headers.py install .devcache/crt     # there (suite.sh install)

``install`` picks the wheel whose CUDA major.minor matches the installed
``nvidia-cuda-runtime`` (else ``nvidia-cuda-nvrtc``), and writes only ``crt/mma.h`` and
``crt/mma.hpp`` (what ``mma.h`` needs; they include only ``cuda_fp16.h``/``cuda_bf16.h``)
where missing, under the ``include`` folder that holds ``mma.h``: no other ``crt/`` header
lands where it could shadow NVRTC's own. It never overwrites a file, and it does nothing
when the headers are already there or nothing matches.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from pathlib import Path

PACKAGE = "nvidia-cuda-crt"
#: The newest release of each CUDA 13 minor version on PyPI (2026-12-01).
VERSIONS = ("13.0.88", "13.1.115", "13.2.86", "13.3.73", "13.4.92", "13.5.37")
CRT_PREFIX = "nvidia/cu13/include/crt/"
#: The crt/ headers written: those ``mma.h`` reaches.
FILES = ("mma.h", "mma.hpp")


def prepare(dest: Path) -> list[Path]:
    """Download ``nvidia-cuda-crt`` wheels (``VERSIONS``) into ``dest``.
    Raises subprocess.CalledProcessError when pip fails."""
    dest.mkdir(parents=True, exist_ok=True)
    plat = []
    for p in ("manylinux_2_35_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64"):
        plat += ["--platform", p]
    for v in VERSIONS:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary=:all:", "--python-version", "3.12", "--implementation",
                        "cp", *plat, "-d", str(dest), f"{PACKAGE}=={v}"], check=True)
    return sorted(dest.glob("nvidia_cuda_crt-*.whl"))


def minor_of(version: str | None) -> str | None:
    """``"13.0"`` from ``"13.0.96"``; None when ``version`` is None or not N.N..."""
    m = re.match(r"(\d+)\.(\d+)", version or "")
    return f"{m.group(1)}.{m.group(2)}" if m else None


def pick_wheel(wheels: list[Path], cuda_version: str | None) -> Path | None:
    """The wheel of ``cuda_version``'s major.minor (the newest if several), else None."""
    want = minor_of(cuda_version)
    found = [w for w in wheels if want and minor_of(w.name.split("-")[1]) == want]
    return sorted(found, key=lambda w: [int(t) for t in w.name.split("-")[1].split(".")])[-1] \
        if found else None


def installed_cuda_version() -> str | None:
    """The installed ``nvidia-cuda-runtime`` version, else ``nvidia-cuda-nvrtc``'s."""
    from importlib import metadata

    for name in ("nvidia-cuda-runtime", "nvidia-cuda-nvrtc"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def include_dirs(search: list[Path]) -> list[Path]:
    """``nvidia/cu13/include`` folders under ``search`` that hold ``mma.h``."""
    out = []
    for root in search:
        d = Path(root) / "nvidia" / "cu13" / "include"
        if (d / "mma.h").is_file():
            out.append(d)
    return out


def install(wheel: Path, include: Path) -> list[str]:
    """Write the ``FILES`` of ``wheel``'s ``crt/`` that ``include/crt/`` lacks; returns
    their names. Existing files are left as they are."""
    written = []
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            rel = name[len(CRT_PREFIX):] if name.startswith(CRT_PREFIX) else None
            if rel not in FILES:
                continue
            target = include / "crt" / rel
            if target.exists():
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(name))
            written.append(rel)
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=("prepare", "install"))
    ap.add_argument("folder", type=Path, help="where the wheels are (or go)")
    a = ap.parse_args(argv)
    if a.mode == "prepare":
        for w in prepare(a.folder):
            print(w)
        return 0
    import site

    dirs = include_dirs([Path(p) for p in site.getsitepackages()])
    if not dirs:
        print("crt headers: no nvidia/cu13/include/mma.h in site-packages: nothing to do")
        return 0
    version = installed_cuda_version()
    wheel = pick_wheel(sorted(a.folder.glob("nvidia_cuda_crt-*.whl")), version)
    if wheel is None:
        print(f"crt headers: no {PACKAGE} wheel for CUDA {version} in {a.folder}")
        return 0
    for d in dirs:
        written = install(wheel, d)
        print(f"crt headers: {len(written)} file(s) from {wheel.name} into {d / 'crt'}"
              f" (CUDA runtime {version})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
