"""The ops take arrays and plain parameters: no module under ``mlx_lily/ops/`` imports
mlx-lm's model code (``mlx_lm.models``) or a private name of another module. Which
mlx-lm classes and attributes make up a block is the patch layer's business
(``mlx_lily/patches/layouts.py``). Checked on the source (AST), not by importing."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

OPS = Path(__file__).resolve().parents[1] / "mlx_lily" / "ops"

#: The one allowed import: the gated delta rule's reference math, a function of mlx-lm's
#: (``gated_delta_update``, ``normalize_qk``), not a model class; ``gated_delta``'s
#: reference defines its contract as that function.
ALLOWED = {("gated_delta.py", "mlx_lm.models.gated_delta",
            frozenset({"gated_delta_update", "normalize_qk"}))}


def violations(source: str, filename: str) -> list[str]:
    """``file:line: what`` for each import of ``mlx_lm.models`` (statement, or a
    ``__import__`` / ``importlib.import_module`` call with a literal name) and each
    import of a private (``_``-prefixed) name from another module in ``source``."""
    out = []

    def models(name: str | None) -> bool:
        return bool(name) and (name == "mlx_lm.models" or name.startswith("mlx_lm.models."))

    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            out += [f"{where}: import {a.name}" for a in node.names if models(a.name)]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            names = frozenset(a.name for a in node.names)
            full = [f"{mod}.{n}" for n in names] if mod == "mlx_lm" else [mod]
            allowed = any(f == filename and m == mod and names <= n for f, m, n in ALLOWED)
            if any(models(m) for m in full) and not allowed:
                out.append(f"{where}: from {mod} import {', '.join(sorted(names))}")
            private = sorted(n for n in names if n.startswith("_") and not n.startswith("__"))
            if private:
                out.append(f"{where}: from {'.' * node.level}{mod} import "
                           f"{', '.join(private)} (private)")
        elif isinstance(node, ast.Call) and node.args:
            fn = node.func
            called = fn.id if isinstance(fn, ast.Name) else getattr(fn, "attr", None)
            arg = node.args[0]
            if (called in ("__import__", "import_module") and isinstance(arg, ast.Constant)
                    and isinstance(arg.value, str) and models(arg.value)):
                out.append(f"{where}: {called}({arg.value!r})")
    return out


def test_ops_import_no_mlx_lm_model_code():
    files = sorted(OPS.glob("*.py"))
    assert len(files) >= 10, files  # the scan sees the package
    found = []
    for f in files:
        found += violations(f.read_text(), f.name)
    assert found == [], "\n".join(found)


def test_allowed_import_is_still_there():
    """The documented exception names a real import (otherwise drop it from ALLOWED)."""
    src = (OPS / "gated_delta.py").read_text()
    assert "from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk" in src


@pytest.mark.parametrize("src", [
    "from mlx_lm.models.switch_layers import SwitchGLU\n",
    "def f():\n    from mlx_lm.models import qwen3_next\n",
    "import mlx_lm.models.qwen3_next as q\n",
    "from mlx_lm import models\n",
    "import importlib\nm = importlib.import_module('mlx_lm.models.qwen3_next')\n",
    "from mlx_lm.models.gated_delta import gated_delta_update, gated_delta_kernel\n",
    "from ..qproj import _private_helper\n",
])
def test_checker_flags(src):
    assert violations(src, "gated_delta.py"), src


@pytest.mark.parametrize("src", [
    "from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk\n",
    "from mlx_lm.models.gated_delta import gated_delta_update\n",
    "from . import moe_route as _route\n",
    "from mlx_lm.generate import stream_generate\n",
])
def test_checker_allows(src):
    assert violations(src, "gated_delta.py") == [], src


def test_exception_is_per_file():
    src = "from mlx_lm.models.gated_delta import gated_delta_update\n"
    assert violations(src, "moe_experts.py")


PATCHES = OPS.parents[1] / "patches"


def test_patch_modules_import_no_private_names():
    """The patch modules (blocks, stack, compiled decode graph, KV growth, projections,
    launch order, layouts, qwen3_5) use each other's public names only. ``qwen3_next``
    is left out: it re-exports the split modules' names, private ones included, for
    the tests and benchmarks that reach into them."""
    files = sorted(f for f in PATCHES.glob("*.py") if f.name != "qwen3_next.py")
    assert len(files) >= 8, files
    found = [v for f in files for v in violations(f.read_text(), f.name)
             if v.endswith("(private)")]
    assert found == [], "\n".join(found)
