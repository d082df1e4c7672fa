#!/usr/bin/env python
"""Thin wrapper: `python benchmarks/primitives.py ...` == `python -m mlx_lily.bench.primitives ...`.

See :mod:`mlx_lily.bench.primitives` for the method and options (`--help`).
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from mlx_lily.bench.primitives import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
