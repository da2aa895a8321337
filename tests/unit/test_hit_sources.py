"""The split of a load's tokens by tier (``core/scheduler/load_jobs.load_sources``)
and the tiers as vLLM's hit sources (``adapters/vllm/hit_sources.py``)."""

from __future__ import annotations

import pytest

from kvoffload.core.jobs import NO_SLOT, EngineJob, JobKind
from kvoffload.core.keys import ChunkKey
from kvoffload.core.scheduler.load_jobs import load_sources


def load(slots: tuple[int, ...], tier: str | None) -> EngineJob:
    keys = tuple(ChunkKey(i.to_bytes(16, "big")) for i in range(len(slots)))
    tier_slots = tuple(range(sum(s == NO_SLOT for s in slots))) if tier else ()
    return EngineJob(
        1, JobKind.LOAD, "r", keys, slots, tuple(range(len(slots))), 1,
        tier=tier, tier_slots=tier_slots,
    )  # fmt: skip


def test_a_host_load_is_all_host() -> None:
    assert load_sources(load((3, 4), None), 32) == {"host": 32}


def test_a_tier_load_splits_by_chunks_and_sums_to_the_hit() -> None:
    assert load_sources(load((3, NO_SLOT, NO_SLOT, NO_SLOT), "disk"), 64) == {
        "host": 16,
        "disk": 48,
    }
    assert load_sources(load((NO_SLOT,) * 4, "redis"), 64) == {"redis": 64}
    odd = load_sources(load((3, NO_SLOT, NO_SLOT), "disk"), 40)
    assert sum(odd.values()) == 40 and odd["disk"] > odd["host"]


def test_a_load_of_invalid_blocks_supplies_nothing() -> None:
    empty = EngineJob(1, JobKind.LOAD, "r", (), (), (), 1, invalid_blocks=(4,))
    assert load_sources(empty, 16) == {}
    assert load_sources(load((3,), None), 0) == {}


def test_each_tier_is_a_vllm_source() -> None:
    pytest.importorskip("vllm")
    from kvoffload.adapters.vllm.compat import CacheHitSource
    from kvoffload.adapters.vllm.hit_sources import SOURCES, hit_sources
    from kvoffload.tiers.registry import tier_names

    assert set(SOURCES) == set(tier_names())
    assert SOURCES["host"] is CacheHitSource.HOST
    assert SOURCES["disk"] is CacheHitSource.DISK
    assert SOURCES["redis"] is CacheHitSource.EXTERNAL_UNSPECIFIED  # a remote store
    assert hit_sources({"host": 16, "disk": 0, "tape": 5}) == {
        CacheHitSource.HOST: 16,
        CacheHitSource.EXTERNAL_UNSPECIFIED: 5,
    }
