"""The two job families validate their own invariants at construction."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvoffload.core.errors import ContractViolation
from kvoffload.core.jobs import EngineJob, JobKind, TierJob
from kvoffload.core.keys import ChunkKey

KEY, KEY2 = ChunkKey(b"\x01" * 16), ChunkKey(b"\x02" * 16)


def test_an_engine_job_is_a_load_or_a_store() -> None:
    load = EngineJob(1, JobKind.LOAD, "a", (KEY, KEY2), (0, 1), (5, 6, 7), 2, skip_blocks=1)
    assert load.chunk_blocks() == [(0, 1, 5), (1, 0, 6), (1, 1, 7)]
    for kind in (JobKind.SPILL, JobKind.PROMOTE):
        with pytest.raises(ContractViolation, match="tier job"):
            EngineJob(2, kind, "a", (KEY,), (0,), (5,), 1)


ST, LD = JobKind.STORE, JobKind.LOAD


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda: EngineJob(1, ST, "a", (KEY,), (0,), (5,), 0), "k > 0"),
        (lambda: EngineJob(1, ST, "a", (KEY,), (0, 1), (5,), 1), "one slot per key"),
        (lambda: EngineJob(1, ST, "a", (), (), (), 1, invalid_blocks=(9,)), "only loads"),
        (lambda: EngineJob(1, LD, "a", (), (), (), 1), "moves no chunk"),
        (lambda: EngineJob(1, ST, "a", (KEY,), (0,), (5,), 2, 1), "skip_blocks 1"),
        (lambda: EngineJob(1, LD, "a", (KEY,), (0,), (5,), 2), "1 blocks for 1 chunks of 2"),
    ],
)
def test_an_engine_job_checks_its_addressing(make: Callable[[], EngineJob], words: str) -> None:
    with pytest.raises(ContractViolation, match=words):
        make()


def test_a_load_of_invalid_blocks_only_moves_no_chunk() -> None:
    job = EngineJob(1, JobKind.LOAD, "a", (), (), (), 2, invalid_blocks=(3, 4))
    assert job.chunk_blocks() == []


def test_a_tier_job_is_a_spill_for_no_request_or_a_promotion_for_one() -> None:
    TierJob(1, JobKind.SPILL, (KEY,), (0,), "disk", (4,))
    TierJob(2, JobKind.PROMOTE, (KEY,), (0,), "disk", request_id="a")
    with pytest.raises(ContractViolation, match="spill none"):
        TierJob(3, JobKind.SPILL, (KEY,), (0,), "disk", request_id="a")
    with pytest.raises(ContractViolation, match="serves a request"):
        TierJob(4, JobKind.PROMOTE, (KEY,), (0,), "disk")
    for kind in (JobKind.LOAD, JobKind.STORE):
        with pytest.raises(ContractViolation, match="engine job"):
            TierJob(5, kind, (KEY,), (0,), "disk", request_id="a")


@pytest.mark.parametrize(
    ("keys", "slots", "tier", "tier_slots", "words"),
    [
        ((KEY, KEY2), (0,), "disk", (), "one slot per key"),
        ((), (), "disk", (), "moves no chunk"),
        ((KEY,), (0,), "", (), "name a tier"),
        ((KEY, KEY2), (0, 1), "disk", (4,), "one tier slot per key"),
    ],
)
def test_a_tier_job_checks_its_slots(
    keys: tuple[ChunkKey, ...],
    slots: tuple[int, ...],
    tier: str,
    tier_slots: tuple[int, ...],
    words: str,
) -> None:
    with pytest.raises(ContractViolation, match=words):
        TierJob(1, JobKind.SPILL, keys, slots, tier, tier_slots)
