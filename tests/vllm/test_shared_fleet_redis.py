"""Harness engines over vLLM's real scheduler sharing a host share too small for
their prefixes and one Redis server below it: what one engine computed comes back
to another from Redis, checked block by block against the KV model (the tier
planner books host chunks under a share through calls that may miss, decision
0017)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fleet_support import serve

from kvoffload.testing.redis_server import RedisServer
from kvoffload.testing.vllm_fuzz.shared_host import BLOCK_BYTES
from kvoffload.testing.vllm_harness import HarnessSpec
from kvoffload.testing.vllm_harness.fleet import SharedFleet

PREFIX = list(range(10, 58))  # three chunks of 16 tokens
OTHER = list(range(200, 248))
HOST_CHUNKS = 3


@pytest.fixture
def fleet(tiny_model: Path, redis_server: RedisServer) -> Iterator[SharedFleet]:
    extra = {"chunk_tokens": 16, "redis_url": redis_server.url, "redis_timeout_ms": 2000}
    spec = HarnessSpec(num_blocks=32, cpu_bytes=HOST_CHUNKS * BLOCK_BYTES, extra=extra)
    made = SharedFleet(tiny_model, spec, 2)
    try:
        yield made
    finally:
        made.close()


def test_an_engine_reads_from_redis_what_another_spilled_under_a_shared_host(
    fleet: SharedFleet,
) -> None:
    serve(fleet, 0, "a", [*PREFIX, 1])
    serve(fleet, 0, "a2", [*OTHER, 1])  # PREFIX leaves the host share, kept in Redis
    host = fleet.counts()
    assert host is not None and host.chunks <= HOST_CHUNKS
    b = serve(fleet, 1, "b", [*PREFIX, 2])
    assert b.loaded_tokens("b") == len(PREFIX)  # its KV checked block by block
    redis = b.scheduler_half.tiers.tier("redis")
    assert redis is not None
    moved = redis.metrics.breakdown("transferred_chunks_total", "direction")
    assert moved.get("load", 0) + moved.get("promote", 0) >= 1
    fleet.quiescent()
