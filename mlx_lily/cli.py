"""Console scripts ``mlx_lily.generate`` and ``mlx_lily.server``: mlx-lm's own commands
with Lily applied, no startup hook needed. Every mlx-lm argument works unchanged; a
``--lily`` flag is accepted and ignored (Lily is always on here).
"""

from __future__ import annotations

import sys


def _run(main_module: str):
    while "--lily" in sys.argv:
        sys.argv.remove("--lily")
    import mlx_lily

    mlx_lily.patch(announce=True)  # one status line once a supported model is loaded
    import importlib

    return importlib.import_module(main_module).main()


def generate_main():
    """``mlx_lily.generate``: ``mlx_lm.generate`` with Lily."""
    return _run("mlx_lm.generate")


def server_main():
    """``mlx_lily.server``: ``mlx_lm.server`` with Lily."""
    return _run("mlx_lm.server")
