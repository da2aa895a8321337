"""The scheduler half's quarantine of timed-out spills and promotions: the memory a
stuck tier I/O may touch stays reserved until every worker that timed it out says
the I/O returned (no engine, no worker)."""

from __future__ import annotations

import itertools

from kvoffload.core.chunk_state import ChunkState
from kvoffload.core.directory import Directory
from kvoffload.core.failures import timeout_failure
from kvoffload.core.jobs import JobKind, JobResult, TierJob
from kvoffload.core.keys import ChunkKey
from kvoffload.core.scheduler.quarantine import Quarantine
from kvoffload.core.tiering.lower import DirectoryTier
from kvoffload.core.tiering.planning import TierPlanner

ids = itertools.count(1).__next__
LATE = timeout_failure("tier read past 5 s")


def K(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def setup() -> tuple[Directory, DirectoryTier, TierPlanner, Quarantine]:
    host = Directory(4)
    disk = DirectoryTier(Directory(8, tier="disk"))
    return host, disk, TierPlanner(host, [disk], chunk_tokens=16), Quarantine(host)


def timed_out(job: TierJob) -> JobResult:
    failed = tuple((i, LATE) for i in range(len(job.keys)))
    return JobResult(job.job_id, False, error=LATE, failed_chunks=failed)


def promoted(host: Directory, disk: DirectoryTier, planner: TierPlanner) -> TierJob:
    """A promotion of K(1), K(2) from the disk tier, reserving two host slots."""
    if disk.present_run([K(1), K(2)]) != 2:
        prepared = host.prepare_store([K(1), K(2)], admit_all=True)
        host.complete_store(prepared.keys, success=True)
        planner.note_stored([K(1), K(2)])
        (spill,) = planner.plan_spills(ids)
        planner.complete(spill, JobResult(spill.job_id, True))
        host.discard([K(1), K(2)])  # evicted from host memory, held by the disk
    job = planner.plan_promotion("r", "disk", [K(1), K(2)], ids)
    assert job is not None and job.kind is JobKind.PROMOTE
    return job


def test_a_timed_out_promotion_keeps_its_host_slots_until_its_read_returns() -> None:
    host, disk, planner, quarantine = setup()
    job = promoted(host, disk, planner)
    result = timed_out(job)
    quarantine.note(0, job, result)
    assert quarantine.park(job, lambda: planner.complete(job, result))
    assert host.state_of(K(1)) is ChunkState.FREE  # a miss now, not a pending store
    assert host.storing_count == 2 and host.free_slots == 2  # the slots stay reserved
    assert quarantine.jobs() == [job] and quarantine.chunks("disk") == 2 and quarantine
    assert disk.directory.pinned_count == 2  # the tier's copies stay booked too
    refill = host.prepare_store([K(7), K(8), K(9)], admit_all=True)
    assert refill.no_room  # nothing may take the quarantined slots
    quarantine.release(0, (job.job_id,))
    assert host.storing_count == 0 and host.free_slots == 4 and not quarantine
    assert disk.present_run([K(1), K(2)]) == 2  # a timed-out chunk is not forgotten
    assert disk.directory.pinned_count == 0
    assert disk.metrics.value("failed_chunks_total", direction="promote") == 2


def test_a_completion_waits_for_every_worker_that_timed_it_out() -> None:
    host, disk, planner, quarantine = setup()
    job = promoted(host, disk, planner)
    result = timed_out(job)
    quarantine.note(0, job, result)  # rank 0 timed out,
    quarantine.note(1, job, JobResult(job.job_id, True))  # rank 1 finished in time
    quarantine.release(0, (job.job_id, 999))  # rank 0's read returned before the completion
    assert not quarantine.park(job, lambda: None)  # nothing held: completes at once
    planner.complete(job, result)
    assert host.storing_count == 0
    job2 = promoted(host, disk, planner)
    quarantine.note(0, job2, timed_out(job2))
    quarantine.note(1, job2, timed_out(job2))
    done: list[int] = []
    assert quarantine.park(job2, lambda: done.append(job2.job_id))
    quarantine.release(1, (job2.job_id,))
    assert done == [] and quarantine.jobs() == [job2]  # rank 0 still reads
    quarantine.release(1, (job2.job_id,))  # a repeated release changes nothing
    quarantine.release(0, (job2.job_id,))
    assert done == [job2.job_id] and not quarantine


def test_a_timed_out_spill_keeps_its_pins_and_tier_room_until_its_write_returns() -> None:
    host, disk, planner, quarantine = setup()
    prepared = host.prepare_store([K(1)], admit_all=True)
    host.complete_store(prepared.keys, success=True)
    planner.note_stored([K(1)])
    (spill,) = planner.plan_spills(ids)
    result = timed_out(spill)
    quarantine.note(0, spill, result)
    assert quarantine.park(spill, lambda: planner.complete(spill, result))
    assert host.state_of(K(1)) is ChunkState.PINNED  # never evicted under the write
    assert disk.directory.storing_count == 1  # its tier slot is not booked again
    quarantine.release(0, (spill.job_id,))
    assert host.pinned_count == 0 and disk.directory.storing_count == 0
    assert host.state_of(K(1)) is ChunkState.READY  # still served from host memory
