"""The tier planner alone: spill admission, pins while spilling, promotion outcomes
and their counters (no engine, no worker)."""

from __future__ import annotations

import itertools

import pytest

from kvoffload.core.chunk_state import ChunkState
from kvoffload.core.directory import Directory
from kvoffload.core.errors import ContractViolation
from kvoffload.core.failures import (
    MISSING,
    ChunkFailure,
    FailureKind,
    integrity_failure,
    io_failure,
)
from kvoffload.core.jobs import JobKind, JobResult
from kvoffload.core.keys import ChunkKey
from kvoffload.core.tiering.lower import DirectoryTier
from kvoffload.core.tiering.planning import TierPlanner


def K(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def setup(
    spill_after_hits: int = 0, disk_slots: int = 8
) -> tuple[Directory, DirectoryTier, TierPlanner]:
    host = Directory(8)
    disk = DirectoryTier(Directory(disk_slots, tier="disk"))
    return (
        host,
        disk,
        TierPlanner(host, [disk], chunk_tokens=16, spill_after_hits=spill_after_hits),
    )


def stored(host: Directory, keys: list[ChunkKey]) -> None:
    prepared = host.prepare_store(keys, admit_all=True)
    host.complete_store(prepared.keys, success=True)


ids = itertools.count(1).__next__


def test_write_through_spills_once_the_host_store_completed_and_pins_meanwhile() -> None:
    host, disk, planner = setup()
    keys = [K(1), K(2)]
    stored(host, keys)
    planner.note_stored(keys)
    (job,) = planner.plan_spills(ids)
    assert job.kind is JobKind.SPILL and job.keys == tuple(keys) and job.tier == "disk"
    assert sorted(job.tier_slots) == [0, 1]  # where the worker writes them in the tier
    assert host.pinned_count == 2  # a spilling chunk cannot be evicted under the worker
    assert planner.plan_spills(ids) == []  # queued once
    planner.complete(job, JobResult(job.job_id, success=True))
    assert host.pinned_count == 0
    assert (
        disk.present_run(keys) == 2
        and disk.metrics.value("transferred_chunks_total", direction="spill") == 2
    )


def test_after_n_hits_a_chunk_spills_on_its_nth_host_load_only() -> None:
    host, _, planner = setup(spill_after_hits=2)
    stored(host, [K(1), K(2)])
    planner.note_stored([K(1), K(2)])
    assert planner.plan_spills(ids) == []  # not on store
    planner.note_loaded([K(1), K(2)])
    assert planner.plan_spills(ids) == []  # one hit each
    planner.note_loaded([K(1)])
    (job,) = planner.plan_spills(ids)
    assert job.keys == (K(1),)


def test_hit_counters_are_bounded() -> None:
    host = Directory(8)
    planner = TierPlanner(
        host,
        [DirectoryTier(Directory(8, tier="disk"))],
        chunk_tokens=16,
        spill_after_hits=2,
        max_counters=3,
    )
    planner.note_loaded([K(i) for i in range(10)])
    assert len(planner._hits) == 3


def test_a_chunk_evicted_from_host_before_its_spill_is_not_spilled() -> None:
    host, _, planner = setup()
    stored(host, [K(1)])
    planner.note_stored([K(1)])
    host.discard([K(1)])
    assert planner.plan_spills(ids) == []


def test_a_full_tier_refuses_the_spill_and_counts_it() -> None:
    host, disk, planner = setup(disk_slots=1)
    stored(host, [K(1), K(2)])
    first = disk.directory.prepare_store([K(9)], admit_all=True)  # the tier's only slot
    assert first.keys == (K(9),)  # storing: neither readable nor evictable
    planner.note_stored([K(1), K(2)])
    assert planner.plan_spills(ids) == []
    assert disk.metrics.value("no_room_total") == 1
    # still queued, still pinned in host memory: not evicted before it is copied down
    assert host.pinned_count == 2 and planner.has_queued()
    disk.directory.complete_store([K(9)], success=True)  # the tier's slot is evictable now
    (job,) = planner.plan_spills(ids)
    assert job.keys == (K(1),) and host.pinned_count == 2  # K(2): no room yet, still queued


@pytest.mark.parametrize(
    ("reason", "forgotten"),
    [
        (integrity_failure("checksum"), True),
        (MISSING, True),
        (io_failure("Input/output error"), False),
    ],
)
def test_promotion_outcomes_per_chunk(reason: ChunkFailure, forgotten: bool) -> None:
    host, disk, planner = setup()
    keys = [K(1), K(2)]
    prepared = disk.directory.prepare_store(keys, admit_all=True)
    disk.directory.complete_store(prepared.keys, success=True)
    job = planner.plan_promotion("r", "disk", keys, ids)
    assert job is not None and job.kind is JobKind.PROMOTE
    assert [host.state_of(k) for k in keys] == [ChunkState.STORING] * 2
    planner.complete(job, JobResult(job.job_id, success=True, failed_chunks=((1, reason),)))
    assert host.state_of(K(1)) is ChunkState.READY and host.state_of(K(2)) is ChunkState.FREE
    assert disk.metrics.value("transferred_chunks_total", direction="promote") == 1
    assert disk.metrics.value("failed_chunks_total", direction="promote") == 1
    assert disk.directory.pinned_count == 0
    assert (disk.present_run([K(2)]) == 0) is forgotten
    assert job.tier_slots == tuple(prepared.slots)  # the worker reads the chunks' slots
    if reason.kind is FailureKind.INTEGRITY:
        assert disk.metrics.breakdown("integrity_errors_total", "reason") == {"checksum": 1}
    if reason.kind is FailureKind.MISSING:
        assert disk.metrics.value("missing_chunks_total") == 1


def test_a_promotion_that_failed_as_a_whole_frees_every_reserved_slot() -> None:
    host, disk, planner = setup()
    prepared = disk.directory.prepare_store([K(1)], admit_all=True)
    disk.directory.complete_store(prepared.keys, success=True)
    job = planner.plan_promotion("r", "disk", [K(1)], ids)
    assert job is not None
    planner.complete(job, JobResult(job.job_id, success=False, error="ConnectionError"))
    assert host.state_of(K(1)) is ChunkState.FREE and len(host) == 0
    assert disk.present_run([K(1)]) == 1  # a failed read says nothing about the copy


def test_tier_jobs_carry_the_groups_the_host_directory_keeps() -> None:
    host = Directory(8)
    disk = DirectoryTier(Directory(8, tier="disk"))
    planner = TierPlanner(host, [disk], chunk_tokens=16, grouped=True)
    keys = [K(1), K(2), K(3)]
    prepared = host.prepare_store(keys, groups=[0, 1, 1])
    assert host.groups_of(prepared.slots) == (0, 1, 1)
    host.complete_store(prepared.keys, success=True)
    planner.note_stored(keys)
    (spill,) = planner.plan_spills(ids)
    assert dict(zip(spill.keys, spill.groups, strict=True)) == {K(1): 0, K(2): 1, K(3): 1}
    planner.complete(spill, JobResult(spill.job_id, success=True))
    host.discard([K(2), K(3)])  # evicted; the planner's entries give their groups back
    job = planner.plan_promotion("r", "disk", [K(2), K(3)], ids, [1, 1])
    assert job is not None and job.groups == (1, 1)
    assert host.groups_of(job.slots) == (1, 1)  # kept with the host slots it fills


def test_one_group_tier_jobs_carry_no_groups() -> None:
    host, _, planner = setup()
    stored(host, [K(1)])
    planner.note_stored([K(1)])
    (spill,) = planner.plan_spills(ids)
    assert spill.groups == ()
    planner.complete(spill, JobResult(spill.job_id, success=True))
    host.discard([K(1)])
    job = planner.plan_promotion("r", "disk", [K(1)], ids)
    assert job is not None and job.groups == ()


def test_a_store_names_one_group_per_key_or_none() -> None:
    host = Directory(8)
    with pytest.raises(ContractViolation):
        host.prepare_store([K(1), K(2)], groups=[1])
    assert len(host) == 0 and host.free_slots == 8  # unchanged
    prepared = host.prepare_store([K(1)])
    assert host.groups_of(prepared.slots) == (0,)


def test_a_chunk_waiting_for_its_spill_is_never_evicted_stores_wait_instead() -> None:
    """Write-through: a queued or spilling chunk holds a host pin, so a store that
    would need to evict it is refused (no_room) rather than the chunk lost; once the
    spill is reported, the chunk is evictable and its eviction is not counted as
    without a copy."""
    host, _, planner = setup()
    keys = [K(i) for i in range(8)]  # fills host memory
    stored(host, keys)
    planner.note_stored(keys)
    assert host.prepare_store([K(20)], admit_all=True).no_room  # queued: pinned
    (job,) = planner.plan_spills(ids)
    assert host.prepare_store([K(20)], admit_all=True).no_room  # spilling: pinned
    planner.complete(job, JobResult(job.job_id, success=True))
    prepared = host.prepare_store([K(20)], admit_all=True)
    assert len(prepared.evicted) == 1  # copied down: evictable
    assert host.metrics.value("evicted_without_copy_total") == 0


def test_a_failed_spill_frees_its_chunks_and_their_eviction_is_counted() -> None:
    host, _, planner = setup()
    keys = [K(i) for i in range(8)]
    stored(host, keys)
    planner.note_stored(keys)
    (job,) = planner.plan_spills(ids)
    planner.complete(job, JobResult(job.job_id, success=False, error="disk gone"))
    assert host.pinned_count == 0  # the tier is failing: the chunks stay readable, evictable
    host.prepare_store([K(20), K(21)], admit_all=True)
    assert host.metrics.value("evicted_without_copy_total") == 2


def test_a_chunk_discarded_while_queued_leaves_the_queue_and_its_slot_frees() -> None:
    host, _, planner = setup()
    stored(host, [K(1), K(2)])
    planner.note_stored([K(1), K(2)])
    host.discard([K(1)])  # pinned by the queue: out of the index, slot held
    assert host.free_slots == 6
    (job,) = planner.plan_spills(ids)
    assert job.keys == (K(2),) and host.free_slots == 7  # K(1)'s pin dropped, slot free
    assert planner.queued_pins() == 0


def test_a_reset_drops_the_queues_pins() -> None:
    host, _, planner = setup()
    stored(host, [K(1), K(2)])
    planner.note_stored([K(1), K(2)])
    planner.reset()
    assert host.pinned_count == 0 and planner.queued_pins() == 0 and not planner.has_queued()
