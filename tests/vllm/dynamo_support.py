"""Dynamo's indexer in tests (``kvoffload.testing.dynamo_indexer``): without
``.venv-dynamo`` a test is skipped, except under CI (``CI`` set), where it fails: CI
runs ``./scripts/test``, which sets it up."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvoffload.testing.dynamo_indexer import (
    Answer,
    Indexer,
    IndexerMissing,
    credited,
    dynamo_python,
    poll,
)

__all__ = ["Answer", "Indexer", "credited", "indexer", "poll"]


def indexer(block_size: int, log: Path) -> Indexer:
    """An :class:`Indexer` (not started), or the test skipped (failed under CI)."""
    try:
        dynamo_python()
    except IndexerMissing as exc:
        if os.environ.get("CI"):
            pytest.fail(str(exc))
        pytest.skip(str(exc))
    return Indexer(block_size, log)
