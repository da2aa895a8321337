"""Deadlines of tier I/O on the real worker: a read or write that hangs past its
deadline is reported failed (TIMEOUT) at the next poll, and the memory it may still
touch is never reused under it. Time is a logical clock the test advances; a hung
call blocks on an event the test sets (in a ``finally`` too); no sleeps."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from kv_engines import Engine, record, vllm_cpu

from kvoffload.core.errors import IllegalTransition
from kvoffload.core.failures import ChunkFailure, FailureKind
from kvoffload.core.jobs import NO_SLOT, EngineJob, JobKind, JobResult, StepPlan, TierJob
from kvoffload.core.keys import ChunkKey
from kvoffload.tiers.disk import DiskStore
from kvoffload.tiers.disk_store import DiskTierStore
from kvoffload.transfer import TransferWorker
from kvoffload.transfer.io_deadlines import DeadlineBook, IoPhase
from kvoffload.transfer.staged_loads import StagedLoads
from kvoffload.transfer.step_backend import TransferBackend
from kvoffload.transfer.tier_worker import TierStore, TierWorker

N, K, HOST_SLOTS = 40, 2, 8
CHUNK = K * 3 * 256  # vllm_cpu: 3 layers of 256-byte pages per block
DIGEST = bytes(range(16))
DEADLINE = 5.0  # logical seconds
WAIT = 30.0  # only so that a broken test fails instead of hanging


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


# ------------------------------------------------------------ the state machine


def test_the_deadline_times_out_queued_and_reading_jobs_only() -> None:
    now = [0.0]
    book: DeadlineBook[str] = DeadlineBook(DEADLINE, lambda: now[0])
    for job_id in (1, 2, 3, 4):
        book.add(job_id, f"job{job_id}")
    assert book.begin_io(2) and book.begin_io(3) and book.begin_copy(3)
    assert book.begin_io(4) and book.finish(4)  # DONE: reported by its thread, gone
    now[0] = DEADLINE - 0.001
    assert book.expire() == []
    now[0] = DEADLINE
    assert book.expire() == ["job1", "job2"]  # the copy of job 3 is never cut short
    assert book.quarantined() == {1, 2}
    assert book.phase(3) is IoPhase.COPYING
    assert not book.begin_io(1)  # timed out while queued: its I/O never starts
    assert not book.begin_copy(2)  # its read came back late: nothing is copied
    assert not book.finish(2) and book.take_returned() == [2]  # result reported already
    assert book.take_returned() == [] and book.quarantined() == {1}
    book.end_copy(3)
    assert book.finish(3)
    assert book.expire() == []  # each job times out once


def test_a_move_outside_the_table_is_a_bug() -> None:
    book: DeadlineBook[int] = DeadlineBook(DEADLINE, lambda: 0.0)
    book.add(1, 1)
    with pytest.raises(IllegalTransition):
        book.begin_copy(1)  # a copy before any read


# ------------------------------------------------------------ the real lanes


class Hung:
    """A tier store whose calls block, after :meth:`hang`, until ``go`` is set;
    ``calls`` counts the calls that reached the store."""

    def __init__(self, inner: TierStore) -> None:
        self.inner = inner
        self.go = threading.Event()
        self.go.set()
        self.entered = threading.Event()
        self.calls = 0

    def _enter(self) -> None:
        self.calls += 1
        self.entered.set()
        assert self.go.wait(WAIT), "hung call never released"

    def write_many(
        self,
        items: Sequence[tuple[ChunkKey, memoryview]],
        slots: Sequence[int],
        groups: Sequence[int] = (),
    ) -> list[ChunkFailure | None]:
        self._enter()
        return self.inner.write_many(items, slots, groups)

    def read_many(
        self,
        keys: Sequence[ChunkKey],
        slots: Sequence[int],
        outs: Sequence[memoryview],
        groups: Sequence[int] = (),
    ) -> list[ChunkFailure | None]:
        self._enter()
        return self.inner.read_many(keys, slots, outs, groups)

    def hang(self) -> None:
        """From now on every call hangs until ``go`` is set; ``calls`` counts from 0."""
        self.go.clear()
        self.entered.clear()
        self.calls = 0


class Rig:
    def __init__(self, root: Path) -> None:
        self.now = 0.0
        self.engine: Engine = vllm_cpu(N)
        self.worker = TransferWorker.for_kv_caches(
            self.engine.caches, N, blocks_per_chunk=K, host_budget_bytes=HOST_SLOTS * CHUNK
        )
        self.disk = Hung(DiskTierStore(DiskStore(root, DIGEST, 0, CHUNK, num_slots=16)))
        clock = lambda: self.now  # noqa: E731
        self.tiers = TierWorker(
            self.worker.slab, {"disk": self.disk}, threads=1, timeout_s=DEADLINE, clock=clock
        )
        self.staged = StagedLoads.open(
            self.worker, self.tiers.stores, staging_bytes=2 * CHUNK, timeout_s=DEADLINE, clock=clock
        )
        self.backend = TransferBackend(
            self.worker, self.tiers, wait_for_loads=True, staged=self.staged
        )
        self.next_id = 100

    def job_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def run(self, job: EngineJob | TierJob) -> JobResult:
        self.submit(job)
        self.worker.wait([job.job_id])
        assert self.tiers.wait([job.job_id], WAIT) and self.staged.wait([job.job_id], WAIT)
        (result,) = self.backend.poll()[0].results
        return result

    def submit(self, job: EngineJob | TierJob) -> None:
        loads = (job,) if isinstance(job, EngineJob) and job.kind is JobKind.LOAD else ()
        self.backend.begin(StepPlan(self.next_id, loads=loads))
        self.backend.submit(job)

    def spilled(self, chunks: dict[int, int]) -> None:
        """Engine blocks ``2k, 2k+1`` of each key ``k`` into host slot ``k``, spilled to
        disk slot ``chunks[k]``."""
        keys = tuple(key(k) for k in chunks)
        slots = tuple(chunks)
        blocks = tuple(b for k in chunks for b in (2 * k, 2 * k + 1))
        store = EngineJob(self.job_id(), JobKind.STORE, "w", keys, slots, blocks, K)
        assert self.run(store).success
        spill = TierJob(self.job_id(), JobKind.SPILL, keys, slots, "disk", tuple(chunks.values()))
        assert self.run(spill).success

    def blocks(self, blocks: Sequence[int]) -> list[bytes]:
        return [record(self.engine, b) for b in blocks]

    def close(self) -> None:
        self.disk.go.set()
        self.staged.shutdown()
        self.tiers.shutdown()
        self.worker.shutdown()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    built = Rig(tmp_path)
    try:
        yield built
    finally:
        built.close()


def tier_load(job_id: int, k: int, blocks: Sequence[int], at: int) -> EngineJob:
    return EngineJob(
        job_id, JobKind.LOAD, f"r{job_id}", (key(k),), (NO_SLOT,), tuple(blocks), K,
        tier="disk", tier_slots=(at,),
    )  # fmt: skip


def test_a_tier_read_past_its_deadline_fails_and_its_late_return_writes_nothing(
    rig: Rig,
) -> None:
    rig.spilled({1: 3, 2: 4})
    before = rig.blocks(range(20, 26))
    rig.disk.hang()
    hung = tier_load(rig.job_id(), 1, [20, 21], at=3)
    rig.submit(hung)
    assert rig.disk.entered.wait(WAIT)
    rig.now = 1.0
    behind = tier_load(rig.job_id(), 2, [22, 23], at=4)  # queued behind the hung read
    rig.submit(behind)
    assert rig.backend.poll()[0].results == ()  # nothing is due yet
    rig.now = DEADLINE
    (result,) = rig.backend.poll()[0].results
    assert result.job_id == hung.job_id and not result.success
    assert [f.kind for _, f in result.failed_chunks] == [FailureKind.TIMEOUT]
    assert isinstance(result.error, ChunkFailure) and result.error.timed_out
    assert rig.backend.take_invalid_blocks() == {20, 21}  # the engine recomputes them
    assert rig.backend.take_loaded() == {hung.request_id}
    assert rig.staged.quarantined() == {hung.job_id}  # its staging slots are the read's
    rig.now = 1.0 + DEADLINE  # the queued load's own deadline, from its submission
    (late,) = rig.backend.poll()[0].results
    assert late.job_id == behind.job_id and late.failed_chunks[0][1].timed_out
    assert rig.staged.quarantined() == {hung.job_id, behind.job_id}
    assert rig.disk.calls == 1  # the queued load never reached the tier
    rig.disk.go.set()  # the hung read returns: its bytes land in staging, nowhere else
    after = tier_load(rig.job_id(), 2, [24, 25], at=4)
    assert rig.run(after).success  # the lane works again, in order after both
    assert rig.disk.calls == 2  # the timed-out queued load was skipped
    assert rig.staged.quarantined() == set()
    assert rig.blocks(range(20, 24)) == before[:4]  # no engine block of a timed-out load
    assert rig.blocks([24, 25]) == rig.blocks([4, 5])
    assert rig.backend.poll()[0].results == ()  # no second result of either


def test_a_read_back_before_the_deadline_is_served(rig: Rig) -> None:
    rig.spilled({1: 3})
    rig.disk.hang()
    job = tier_load(rig.job_id(), 1, [20, 21], at=3)
    rig.submit(job)
    assert rig.disk.entered.wait(WAIT)
    rig.now = DEADLINE - 0.01
    assert rig.backend.poll()[0].results == ()
    rig.disk.go.set()
    assert rig.staged.wait([job.job_id], WAIT)
    (result,) = rig.backend.poll()[0].results
    assert result.success and rig.blocks([20, 21]) == rig.blocks([2, 3])


@pytest.mark.parametrize("kind", [JobKind.PROMOTE, JobKind.SPILL])
def test_a_tier_job_past_its_deadline_is_released_only_when_its_io_returns(
    rig: Rig, kind: JobKind
) -> None:
    rig.spilled({1: 3})
    rig.disk.hang()
    request = "r" if kind is JobKind.PROMOTE else None
    job = TierJob(rig.job_id(), kind, (key(1),), (5,), "disk", (6,), request)
    rig.submit(job)
    assert rig.disk.entered.wait(WAIT)
    behind = TierJob(rig.job_id(), kind, (key(1),), (6,), "disk", (7,), request)
    rig.submit(behind)  # one tier thread: queued behind the hung call
    rig.now = DEADLINE
    report = rig.backend.poll()[0]
    assert {r.job_id for r in report.results} == {job.job_id, behind.job_id}
    for result in report.results:
        assert not result.success and result.nbytes == 0
        assert [f.kind for _, f in result.failed_chunks] == [FailureKind.TIMEOUT]
    assert report.released == ()  # the hung call may still touch host slot 5
    assert rig.tiers.quarantined() == {job.job_id, behind.job_id}
    rig.disk.go.set()
    after = TierJob(rig.job_id(), JobKind.SPILL, (key(1),), (1,), "disk", (8,))
    rig.submit(after)
    assert rig.tiers.wait([after.job_id], WAIT)  # one thread, in order: the two came back
    report = rig.backend.poll()[0]
    assert [r.job_id for r in report.results] == [after.job_id] and report.results[0].success
    assert sorted(report.released) == [job.job_id, behind.job_id]
    assert rig.disk.calls == 2  # the queued job never started its I/O
    assert rig.tiers.quarantined() == set()
    assert rig.backend.poll()[0].released == ()  # each once
