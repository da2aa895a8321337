"""Tests import bench/'s scripts through :func:`bench_module` (bench/ is a folder of
scripts, not a package: it is on ``sys.path`` only while one is imported)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

BENCH = str(Path(__file__).resolve().parents[1] / "bench")


def bench_module(name: str) -> Any:
    """``bench/<name>.py``, imported (its own imports of bench/ modules included)."""
    sys.path.insert(0, BENCH)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(BENCH)
