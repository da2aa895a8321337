"""The two job families validate their own invariants at construction; the job
tracker, their one owner, answers what each request has in flight."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvoffload.core.errors import ContractViolation
from kvoffload.core.jobs import NO_SLOT, EngineJob, JobKind, JobResult, TierJob
from kvoffload.core.keys import ChunkKey
from kvoffload.core.scheduler.job_tracker import JobTracker

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


def test_a_tier_job_names_one_kv_cache_group_per_key_or_none() -> None:
    assert TierJob(1, JobKind.SPILL, (KEY, KEY2), (0, 1), "disk").groups == ()
    assert TierJob(2, JobKind.SPILL, (KEY, KEY2), (0, 1), "disk", groups=(0, 1)).groups == (0, 1)
    with pytest.raises(ContractViolation, match="one KV cache group per key"):
        TierJob(3, JobKind.SPILL, (KEY, KEY2), (0, 1), "disk", groups=(1,))


def test_the_tracker_answers_what_a_request_has_in_flight() -> None:
    tracker = JobTracker(2)
    store = EngineJob(1, JobKind.STORE, "a", (KEY,), (0,), (7,), 1)
    promotion = TierJob(2, JobKind.PROMOTE, (KEY2,), (1,), "disk", request_id="a")
    spill = TierJob(3, JobKind.SPILL, (KEY,), (0,), "disk")
    load = EngineJob(4, JobKind.LOAD, "b", (KEY,), (0,), (8,), 1)
    for job in (store, promotion, spill, load):
        tracker.add(job)
    assert tracker.jobs_of("a") == (store, promotion) and tracker.store_ids("a") == [1]
    assert tracker.has_promotion("a") and not tracker.has_load("a")
    assert tracker.has_load("b") and not tracker.has_jobs("c") and tracker.jobs_of("c") == ()
    assert tracker.record(0, JobResult(1, True)) is None  # one of two workers
    assert tracker.jobs_of("a") == (store, promotion)
    assert tracker.record(1, JobResult(1, True)) is not None
    assert tracker.jobs_of("a") == (promotion,) and tracker.store_ids("a") == []
    for rank in (0, 1):
        tracker.record(rank, JobResult(2, False))
        tracker.record(rank, JobResult(3, True))  # a spill: in no request's index
    assert not tracker.has_jobs("a") and tracker.has_jobs("b") and len(tracker) == 1


def _tier_load(slots: tuple[int, ...], **kw: object) -> EngineJob:
    keys = tuple(ChunkKey(bytes([i]) * 16) for i in range(len(slots)))
    fields: dict[str, object] = {"tier": "disk"}
    fields.update(kw)
    return EngineJob(
        job_id=7,
        kind=JobKind.LOAD,
        request_id="r",
        keys=keys,
        slots=slots,
        block_ids=tuple(range(10, 10 + 2 * len(slots) - 1)),
        blocks_per_chunk=2,
        skip_blocks=1,
        **fields,  # type: ignore[arg-type]
    )


def test_a_tier_load_reads_its_no_slot_chunks_from_its_tier() -> None:
    job = _tier_load((4, NO_SLOT, NO_SLOT), tier_slots=(9, 8))
    assert job.host_chunks() == (0,) and job.tier_chunks() == (1, 2)
    host = job.part(job.host_chunks(), (4,))
    assert (host.keys, host.slots, host.block_ids, host.skip_blocks) == (
        job.keys[:1],
        (4,),
        (10,),
        1,
    )
    staged = job.part(job.tier_chunks(), (0, 1))
    assert staged.block_ids == (11, 12, 13, 14) and staged.skip_blocks == 0
    assert staged.tier is None and staged.job_id == job.job_id
    both = job.part((0, 2), (4, 0))
    assert both.block_ids == (10, 13, 14) and both.skip_blocks == 1


@pytest.mark.parametrize(
    "make",
    [
        lambda: _tier_load((4, NO_SLOT), tier=None),  # NO_SLOT without a tier
        lambda: _tier_load((4, 5)),  # a tier, no chunk from it
        lambda: _tier_load((NO_SLOT, NO_SLOT), tier_slots=(1,)),
        lambda: _tier_load((NO_SLOT, NO_SLOT), groups=(1,)),
    ],
)
def test_a_tier_load_checks_its_tier_fields(make: Callable[[], EngineJob]) -> None:
    with pytest.raises(ContractViolation):
        make()


def test_only_a_load_reads_from_a_tier() -> None:
    with pytest.raises(ContractViolation):
        EngineJob(7, JobKind.STORE, "r", (ChunkKey(b"k" * 16),), (NO_SLOT,), (1, 2), 2, tier="disk")
