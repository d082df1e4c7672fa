"""The ``--lily`` startup hook (``mlx_lily_hook.pth``) ships with a wheel install and with an
editable one (``pip install -e .``) alike.

Each test installs a copy of the package (no dependencies) into a fresh virtual
environment whose own site-packages comes first and which reads this environment's
packages (MLX, mlx-lm, pip) through a path entry, so nothing is downloaded but the build
backend pip's isolated build asks for. It then checks, in new processes of that
environment, that the hook module was loaded at start-up from the installed copy, and that
``python -m mlx_lm.generate ... --lily`` gets past mlx-lm's argument parser (without the
hook: "unrecognized arguments: --lily").
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PTH = "mlx_lily_hook.pth"
#: What the build reads: the package's sources and its metadata.
SOURCES = ("pyproject.toml", "setup.py", "README.md", PTH, "mlx_lily", "patches", "shaders")

pytestmark = pytest.mark.slow


def _copy_sources(dst: Path) -> Path:
    dst.mkdir()
    for name in SOURCES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dst / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(src, dst / name)
    return dst


def _fresh_venv(path: Path) -> Path:
    """A venv without pip whose site-packages is followed by this environment's packages:
    links to them in one folder on its path, leaving out this environment's own mlx-lily
    (an installed copy, or an editable install's finder) and every ``.pth`` file."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    py = path / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    shadow = path / "parent-packages"
    shadow.mkdir()
    for parent in dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")):
        for entry in Path(parent).iterdir():
            name = entry.name
            if (name.startswith(("mlx_lily", "__editable__")) or name.endswith(".pth")
                    or (shadow / name).exists()):
                continue
            (shadow / name).symlink_to(entry)
    Path(site, "_parent_packages.pth").write_text(f"{shadow}\n")
    return py


def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLX_LILY", "PYTHON"))}
    env.update(HF_HUB_OFFLINE="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def _pip(py: Path, *args, cwd: Path):
    r = subprocess.run([str(py), "-m", "pip", *args], cwd=cwd, env=_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]


def _assert_hook_works(py: Path, package_root: Path, tmp_path: Path):
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    assert (Path(site) / PTH).is_file(), f"{PTH} not installed in {site}"
    probe = ("import sys; m = sys.modules.get('mlx_lily._hook'); "
             "print(m.__file__ if m else 'not loaded')")
    r = subprocess.run([str(py), "-c", probe], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    loaded = Path(r.stdout.strip())
    assert loaded.is_relative_to(package_root), (loaded, package_root)
    # a model path that fails to load: mlx-lm exits after parsing its arguments
    r = subprocess.run([str(py), "-m", "mlx_lm.generate", "--model", str(tmp_path / "no-model"),
                        "--prompt", "hi", "--lily"], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=120)
    assert "unrecognized arguments" not in r.stderr, r.stderr[-2000:]
    assert r.returncode not in (0, 2), (r.returncode, r.stderr[-2000:])


def test_editable_install_ships_the_hook(tmp_path):
    src = _copy_sources(tmp_path / "src")
    py = _fresh_venv(tmp_path / "venv")
    _pip(py, "install", "--no-deps", "-e", str(src), cwd=tmp_path)
    _assert_hook_works(py, src, tmp_path)


def test_wheel_install_ships_the_hook(tmp_path):
    src = _copy_sources(tmp_path / "src")
    py = _fresh_venv(tmp_path / "venv")
    _pip(py, "wheel", "--no-deps", "-w", str(tmp_path / "dist"), str(src), cwd=tmp_path)
    (whl,) = (tmp_path / "dist").glob("mlx_lily-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    assert PTH in names and "mlx_lily/_hook.py" in names, names[:20]
    _pip(py, "install", "--no-deps", str(whl), cwd=tmp_path)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    _assert_hook_works(py, Path(site), tmp_path)
