"""Small simulator settings shared by the simulator tests: tiny chunks, a small engine."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kvoffload.simulate.cost import CostModel
from kvoffload.simulate.report import SimResult
from kvoffload.simulate.runner import SimConfig, run_simulation
from kvoffload.simulate.trace import TraceRequest

BYTES_PER_TOKEN = 1024
CHUNK = 32  # tokens per chunk in these tests
CHUNK_BYTES = CHUNK * BYTES_PER_TOKEN


def config(**overrides: Any) -> SimConfig:
    settings: dict[str, Any] = {
        "cpu_bytes": 1024 * CHUNK_BYTES,
        "engine_tokens": 4096,
        "block_size": 16,
        "chunk_tokens": CHUNK,
        "token_budget": 512,
        "max_running": 8,
        "decode_stride": 8,
        "cost": CostModel(bytes_per_token=BYTES_PER_TOKEN),
    }
    settings.update(overrides)
    return SimConfig(**settings)


def simulate(requests: Iterable[TraceRequest], **overrides: Any) -> SimResult:
    return run_simulation(config(**overrides), list(requests))


def seg(t: float, *segments: tuple[str, int], output: int = 4, **kw: Any) -> TraceRequest:
    return TraceRequest(t, output, segments=tuple(segments), where=f"test t={t}", **kw)
