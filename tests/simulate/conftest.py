"""Fixtures of the simulator tests."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def tmp_trace(tmp_path: Any) -> Any:
    def write(*lines: str) -> str:
        path = tmp_path / "trace.jsonl"
        path.write_text("".join(line + "\n" for line in lines))
        return str(path)

    return write
