"""Settings for tests against a real vLLM (the tiny model fixture is in tests/conftest.py)."""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture
def make(tiny_model: Path) -> Iterator[Any]:
    """Build harnesses over vLLM's real scheduler (``VllmHarness`` keywords); every
    one built is closed at the end of the test, on failure too."""
    from kvoffload.testing.vllm_harness import VllmHarness

    made: list[VllmHarness] = []

    def build(**kwargs: Any) -> VllmHarness:
        h = VllmHarness(tiny_model, **kwargs)
        made.append(h)
        return h

    yield build
    for h in made:
        h.close()


@pytest.fixture
def children() -> Iterator[list[Any]]:
    """Engines in processes of their own (``share_support.Child``) a test appends
    here; every one still running at the end is killed by pid, on failure too."""
    made: list[Any] = []
    yield made
    for child in made:
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait()
