"""A worker whose jobs run and complete only when the caller says so.

:class:`ManualWorker` is a :class:`~kvoffload.core.step_runner.StepBackend`: the
engine drives it through a :class:`~kvoffload.core.step_runner.StepRunner` (which
submits a step's stores after its forward pass, flushed ones before). It keeps the
host tier in memory (one bytes object per slot) and copies real bytes between it and
the engine's block pool. When a job runs is decided by a
*completion policy* (``step, runnable jobs -> {job id: success}``), except that a
flushed store runs at once, before the forward pass. A store may run only after the
forward pass of the step that planned it (it captures that step's KV), a load any
time; a failed store leaves garbage in its slots and a failed load leaves garbage in
its blocks, as a torn copy would.

While it works it checks what the scheduler half promised, raising
:class:`InvariantViolation`:

- no load is planned for a request whose stores are not yet acknowledged (applied
  by the engine to the scheduler half);
- no engine block is written while a store that reads it has not run (the forward
  pass of the step that planned a store may write that store's blocks);
- a store captures exactly the KV its key names, a load reads exactly the bytes
  stored under its key, from a chunk of the loading request's own key chain
  (``expected`` gives the reference bytes; see :mod:`kvoffload.testing.oracle`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvoffload.core.failures import ChunkFailure
from kvoffload.core.jobs import (
    EngineJob,
    JobKind,
    JobResult,
    StepPlan,
    TierJob,
    TransferJob,
    WorkerReport,
)
from kvoffload.core.keys import ChunkKey
from kvoffload.engine.block_pool import BlockPool


class InvariantViolation(AssertionError):
    """A promise of the scheduler half was broken (found by a check, not a crash)."""


@dataclass
class PendingJob:
    """A job planned and not reported yet; mutated by its worker only."""

    job: TransferJob
    planned_step: int
    ran: bool = False  # its copy ran (a flush, or the policy picked it)
    runnable: bool = False  # submitted: the policy may pick it


CompletionPolicy = Callable[[int, Sequence[PendingJob]], dict[int, bool]]
Expected = Callable[[EngineJob, int], bytes]  # (job, index of a chunk in it) -> bytes


def complete_everything(step: int, jobs: Sequence[PendingJob]) -> dict[int, bool]:
    """The default policy: every runnable job completes successfully at once."""
    return {p.job.job_id: True for p in jobs}


class ManualWorker:
    """See the module docstring. Owns the in-memory host and lower tiers and the
    pending jobs; writes the engine's block pool (loads) and hooks its writes."""

    def __init__(
        self,
        pool: BlockPool,
        num_slots: int,
        *,
        world_size: int = 1,
        policy: CompletionPolicy = complete_everything,
        expected: Expected | None = None,
    ) -> None:
        self.pool = pool
        self.world_size = world_size
        self.policy = policy
        self.expected = expected
        self.host: list[bytes | None] = [None] * num_slots
        self.host_key: list[ChunkKey | None] = [None] * num_slots
        # In-memory lower tiers: tier slot -> (chunk key, bytes, KV cache group).
        self.lower: dict[str, dict[int, tuple[ChunkKey, bytes, int]]] = {}
        self.known: dict[ChunkKey, bytes] = {}  # the bytes every verified store captured
        self.pending: dict[int, PendingJob] = {}
        self.unacknowledged: dict[int, TransferJob] = {}
        self.step = 0
        self.in_forward = False
        self.copies = 0
        pool.on_write = self._check_write

    # ------------------------------------------------------------ backend calls

    def begin(self, plan: StepPlan) -> None:
        """Take every job of ``plan`` as pending (stores, loads, spills, promotions)
        and check its loads; from now on the step is in its forward pass (the flush
        that follows runs only stores, which read blocks and write none)."""
        self.step = plan.step
        jobs: tuple[TransferJob, ...] = (*plan.stores, *plan.loads, *plan.spills, *plan.promotions)
        for job in jobs:
            self.pending[job.job_id] = PendingJob(job, plan.step)
            self.unacknowledged[job.job_id] = job
        for load in plan.loads:
            stores = [
                j.job_id
                for j in self.unacknowledged.values()
                if j.request_id == load.request_id and j.kind is JobKind.STORE
            ]
            if stores:
                raise InvariantViolation(
                    f"step {plan.step}: load job {load.job_id} for {load.request_id!r} issued "
                    f"while its store jobs {stores} are unacknowledged"
                )
        self.in_forward = True

    def submit(self, job: TransferJob) -> None:
        """The job may complete from now on (a store is submitted after the forward
        pass of its step, unless flushed: a flushed store has run by then)."""
        self.pending[job.job_id].runnable = True

    def wait(self, job_ids: frozenset[int]) -> None:
        """The flush: run every named job not run yet, successfully, in id order."""
        for job_id in sorted(job_ids):
            pending = self.pending.get(job_id)
            if pending is not None and not pending.ran:
                self._run(pending, success=True)

    def end_forward(self) -> None:
        self.in_forward = False

    def poll(self) -> list[WorkerReport]:
        """Complete what the policy picks of the runnable jobs (running each one not
        run yet, with the policy's success); the same report for every rank."""
        runnable = [p for p in self.pending.values() if p.runnable]
        chosen = self.policy(self.step, runnable) if runnable else {}
        results = []
        for job_id, success in chosen.items():
            pending = self.pending.pop(job_id)
            failed: tuple[tuple[int, ChunkFailure], ...] = ()
            if isinstance(pending.job, TierJob):
                failed = self._run_tier(pending.job, success)
            elif not pending.ran:
                self._run(pending, success)
            results.append(JobResult(job_id, success, len(pending.job.keys), failed_chunks=failed))
        return [WorkerReport(rank, tuple(results)) for rank in range(self.world_size)]

    def applied(self, reports: Sequence[WorkerReport]) -> None:
        """The engine applied ``reports`` to the scheduler half."""
        for report in reports:
            for result in report.results:
                self.unacknowledged.pop(result.job_id, None)

    # ------------------------------------------------------------ copies

    def _run(self, pending: PendingJob, success: bool) -> None:
        job = pending.job
        assert isinstance(job, EngineJob)
        pending.ran = True
        self.copies += 1
        k, block_bytes = job.blocks_per_chunk, self.pool.block_bytes
        if job.kind is JobKind.STORE:
            for i, slot in enumerate(job.slots):
                blocks = job.block_ids[i * k : (i + 1) * k]
                data = b"".join(self.pool.read(b) for b in blocks)
                if not success:
                    self.host[slot], self.host_key[slot] = b"\xee" * len(data), None
                    continue
                self._verify(job, i, data, "store captured")
                self.host[slot], self.host_key[slot] = data, job.keys[i]
                self.known[job.keys[i]] = data
            return
        for slot, index, block in job.chunk_blocks():
            chunk = job.slots.index(slot)
            if not success:
                self.pool.write(block, 0, b"\xdd" * block_bytes)
                continue
            held = self.host[slot]
            if held is None or self.host_key[slot] != job.keys[chunk]:
                raise InvariantViolation(
                    f"step {self.step}: load job {job.job_id} reads slot {slot}, which holds "
                    f"{'nothing' if held is None else 'another chunk'}"
                )
            self._verify(job, chunk, held, "load read")
            self.pool.write(block, 0, held[index * block_bytes : (index + 1) * block_bytes])

    def _run_tier(self, job: TierJob, success: bool) -> tuple[tuple[int, ChunkFailure], ...]:
        """Run a spill or a promotion against the in-memory tier, slot-addressed like
        the disk tier (authoritative: a promotion whose tier slot does not hold its
        chunk, or holds it as another KV cache group than the job expects, is a
        violation, which catches a slot reused while still needed); return the chunks
        that did not make it (none: a job succeeds or fails whole here)."""
        self.copies += 1
        tier = self.lower.setdefault(job.tier, {})
        if len(job.tier_slots) != len(job.keys):
            raise InvariantViolation(f"step {self.step}: tier job {job.job_id} without tier slots")
        groups = job.groups or (0,) * len(job.keys)
        if job.kind is JobKind.SPILL:
            each = zip(job.keys, job.slots, job.tier_slots, groups, strict=True)
            for key, slot, tier_slot, group in each:
                held = self.host[slot]
                if held is None or self.host_key[slot] != key or held != self.known.get(key):
                    raise InvariantViolation(
                        f"step {self.step}: spill job {job.job_id} reads slot {slot}, which does "
                        "not hold the chunk's bytes"
                    )
                if success:
                    tier[tier_slot] = (key, held, group)
                else:
                    tier[tier_slot] = (key, b"\xcc", group)  # a torn write: never readable
            return ()
        for key, slot, tier_slot, group in zip(
            job.keys, job.slots, job.tier_slots, groups, strict=True
        ):
            if not success:
                self.host[slot], self.host_key[slot] = b"\xcc", None  # a torn copy
                continue
            stored = tier.get(tier_slot)
            if stored is None or stored[0] != key:
                raise InvariantViolation(
                    f"step {self.step}: promotion job {job.job_id} reads tier {job.tier!r} slot "
                    f"{tier_slot}, which does not hold its chunk"
                )
            if stored[1] != self.known.get(key):
                raise InvariantViolation(
                    f"step {self.step}: promotion job {job.job_id} found wrong bytes in tier"
                )
            if stored[2] != group:
                raise InvariantViolation(
                    f"step {self.step}: promotion job {job.job_id} expects group {group} of a "
                    f"chunk spilled as group {stored[2]}"
                )
            self.host[slot], self.host_key[slot] = stored[1], key
        return ()

    def _verify(self, job: EngineJob, chunk: int, data: bytes, what: str) -> None:
        if self.expected is None:
            return
        if data != self.expected(job, chunk):
            raise InvariantViolation(
                f"step {self.step}: {job.kind.value} job {job.job_id} of {job.request_id!r}: "
                f"{what} wrong bytes for chunk {chunk}"
            )

    def _check_write(self, blocks: Sequence[int]) -> None:
        for pending in self.pending.values():
            job = pending.job
            if not isinstance(job, EngineJob) or job.kind is not JobKind.STORE or pending.ran:
                continue
            if self.in_forward and pending.planned_step == self.step:
                continue  # this step's forward pass computes what the store captures
            hit = [b for b in blocks if b in job.block_ids]
            if hit:
                raise InvariantViolation(
                    f"step {self.step}: block {hit[0]} written while store job {job.job_id} "
                    f"of {job.request_id!r}, which reads it, has not run"
                )
