"""The reference engine's manual worker runs tier loads against its in-memory tiers:
the bytes a store captured land in the engine blocks, the scheduler half's promises
about tier slots are checked, and a failed or damaged tier load reports its failed
chunks without a bad chunk ever reaching an engine block."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvoffload.core.failures import MISSING, error_failure, integrity_failure
from kvoffload.core.jobs import (
    NO_BLOCK,
    NO_SLOT,
    EngineJob,
    JobKind,
    JobResult,
    StepPlan,
    TierJob,
    TransferJob,
)
from kvoffload.core.keys import ChunkKey
from kvoffload.engine.block_pool import BlockPool
from kvoffload.engine.manual_worker import InvariantViolation, ManualWorker, PendingJob

K = 2  # blocks per chunk
TORN = integrity_failure("checksum")


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


class Rig:
    """A block pool with distinct bytes in every block and a manual worker whose
    policy fails the job ids in ``failing``."""

    def __init__(self, **worker_options: object) -> None:
        self.pool = BlockPool(32, 2)
        for b in range(32):
            self.pool.data[b * self.pool.block_bytes : (b + 1) * self.pool.block_bytes] = (
                bytes([b]) * self.pool.block_bytes
            )
        self.failing: set[int] = set()
        self.worker = ManualWorker(self.pool, 8, policy=self.decide, **worker_options)  # type: ignore[arg-type]
        self.step = 0
        self.next_id = 0

    def decide(self, step: int, jobs: Sequence[PendingJob]) -> dict[int, bool]:
        return {p.job.job_id: p.job.job_id not in self.failing for p in jobs}

    def job_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def run(self, job: TransferJob) -> JobResult:
        """One step with ``job`` alone, reported and acknowledged."""
        self.step += 1
        if isinstance(job, TierJob):
            field = "spills" if job.kind is JobKind.SPILL else "promotions"
            plan = StepPlan(self.step, **{field: (job,)})  # type: ignore[arg-type]
        else:
            field = "loads" if job.kind is JobKind.LOAD else "stores"
            plan = StepPlan(self.step, **{field: (job,)})  # type: ignore[arg-type]
        self.worker.begin(plan)
        self.worker.end_forward()
        self.worker.submit(job)
        reports = self.worker.poll()
        self.worker.applied(reports)
        (result,) = reports[0].results
        return result

    def put(self, chunks: dict[int, tuple[int, int]], groups: Sequence[int] = ()) -> None:
        """Store ``chunks`` (key -> (first block, disk slot)) in host slots 0.. and
        spill them to the disk tier."""
        keys = tuple(key(k) for k in chunks)
        slots = tuple(range(len(chunks)))
        blocks = tuple(b for first, _ in chunks.values() for b in range(first, first + K))
        assert self.run(
            EngineJob(self.job_id(), JobKind.STORE, "w", keys, slots, blocks, K)
        ).success
        at = tuple(s for _, s in chunks.values())
        spill = TierJob(self.job_id(), JobKind.SPILL, keys, slots, "disk", at, None, tuple(groups))
        assert self.run(spill).success

    def blocks(self, blocks: Sequence[int]) -> list[bytes]:
        return [self.pool.read(b) for b in blocks]


def tier_load(
    job_id: int,
    keys: Sequence[int],
    slots: Sequence[int],
    blocks: Sequence[int],
    at: Sequence[int],
    *,
    groups: Sequence[int] = (),
    skip: int = 0,
) -> EngineJob:
    return EngineJob(
        job_id, JobKind.LOAD, "r", tuple(key(k) for k in keys), tuple(slots), tuple(blocks), K,
        skip, tier="disk", tier_slots=tuple(at), groups=tuple(groups),
    )  # fmt: skip


def test_a_tier_load_lands_the_stored_bytes_with_host_chunks_and_skipped_blocks() -> None:
    rig = Rig()
    rig.put({1: (0, 5), 2: (2, 6), 3: (4, 7)})
    want = rig.blocks(range(6))
    job = tier_load(
        rig.job_id(), [1, 2, 3], [0, NO_SLOT, NO_SLOT], [21, 22, 23, NO_BLOCK, 25], [6, 7], skip=1
    )
    before = rig.pool.read(24)
    result = rig.run(job)
    assert result.success and result.failed_chunks == () and result.error == ""
    assert rig.blocks([21, 22, 23, 25]) == [want[1], want[2], want[3], want[5]]
    assert rig.pool.read(24) == before  # not named: not written


def test_a_damaged_tier_slot_fails_the_load_and_is_dropped() -> None:
    rig = Rig()
    rig.put({1: (0, 5), 2: (2, 6)})
    rig.worker.damage("disk", 6)
    before = rig.blocks(range(20, 24))
    result = rig.run(tier_load(rig.job_id(), [1, 2], [NO_SLOT] * 2, range(20, 24), [5, 6]))
    assert not result.success and result.failed_chunks == ((1, TORN),) and result.error == TORN
    assert rig.blocks(range(20, 24)) == before  # no tier chunk reached an engine block
    assert 6 not in rig.worker.lower["disk"]  # the tier dropped its bad copy
    with pytest.raises(InvariantViolation, match="does not hold its chunk"):
        rig.run(tier_load(rig.job_id(), [2], [NO_SLOT], [20, 21], [6]))  # read again: a bug


def test_a_failed_tier_load_reports_its_failed_chunks_and_writes_no_tier_chunk() -> None:
    rig = Rig()
    rig.put({1: (0, 5), 2: (2, 6)})
    job = tier_load(rig.job_id(), [1, 2], [0, NO_SLOT], range(20, 24), [6])
    rig.failing.add(job.job_id)
    result = rig.run(job)
    assert not result.success and result.failed_chunks == ((1, TORN),)
    untouched = [bytes([b]) * rig.pool.block_bytes for b in (22, 23)]
    assert rig.blocks([22, 23]) == untouched  # the tier chunk never reached its blocks
    assert rig.blocks([20, 21]) == [b"\xdd" * rig.pool.block_bytes] * 2  # a torn host copy
    assert 6 not in rig.worker.lower["disk"]


@pytest.mark.parametrize("failure", [MISSING, error_failure("ConnectionError: down")])
def test_the_failure_of_a_tier_load_is_the_callers_choice(failure: object) -> None:
    rig = Rig(fail_tier_load=lambda job: ((job.tier_chunks()[-1], failure),))
    rig.put({1: (0, 5), 2: (2, 6)})
    job = tier_load(rig.job_id(), [1, 2], [NO_SLOT] * 2, range(20, 24), [5, 6])
    rig.failing.add(job.job_id)
    result = rig.run(job)
    assert not result.success and result.failed_chunks == ((1, failure),)
    kept = failure is not MISSING  # an error keeps the tier's copy, a missing chunk is gone
    assert (6 in rig.worker.lower["disk"]) is kept


def test_a_tier_load_of_a_reused_slot_or_another_group_is_a_violation() -> None:
    rig = Rig()
    rig.put({1: (0, 5), 2: (2, 6)}, groups=[0, 1])
    with pytest.raises(InvariantViolation, match="does not hold its chunk"):
        rig.run(tier_load(rig.job_id(), [1], [NO_SLOT], [20, 21], [6]))
    with pytest.raises(InvariantViolation, match="expects group 0 of a chunk spilled as group 1"):
        rig.run(tier_load(rig.job_id(), [2], [NO_SLOT], [20, 21], [6], groups=[0]))
    with pytest.raises(InvariantViolation, match="without tier slots"):
        rig.run(tier_load(rig.job_id(), [2], [NO_SLOT], [20, 21], []))
    rig2 = Rig()
    rig2.put({1: (0, 5)})
    rig2.worker.lower["disk"][5] = (key(1), b"not the chunk", 0)
    with pytest.raises(InvariantViolation, match="wrong bytes"):
        rig2.run(tier_load(rig2.job_id(), [1], [NO_SLOT], [20, 21], [5]))


def test_a_damaged_promotion_chunk_fails_alone() -> None:
    rig = Rig()
    rig.put({1: (0, 5), 2: (2, 6)})
    rig.worker.damage("disk", 5)
    promote = TierJob(rig.job_id(), JobKind.PROMOTE, (key(1), key(2)), (3, 4), "disk", (5, 6), "r")
    result = rig.run(promote)
    assert result.success and result.failed_chunks == ((0, TORN),)
    assert rig.worker.host_key[3] is None and rig.worker.host_key[4] == key(2)
