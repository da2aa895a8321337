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
  (``expected`` gives the reference bytes; see :mod:`kvoffload.testing.oracle`);
- a spill reads a host slot holding its chunk's bytes; a promotion or a tier load
  reads a tier slot holding its chunk, as the KV cache group it expects, with the
  bytes a store captured (the lower tiers are slot-addressed like the disk tier and
  authoritative: this catches a tier slot reused while still needed).

Each job runs as its legs (:func:`kvoffload.core.tiering.routes.legs`), each by its route
(one table, ``_LEGS``; the legs to and from the lower tiers are in
:mod:`kvoffload.engine.manual_tier_legs`), the legs' results merged
(:func:`kvoffload.core.tiering.routes.merge`). A tier load's leg from host memory is read as
any load's, its leg from a lower tier from the in-memory tier. A tier slot marked
by :meth:`ManualWorker.damage` is found corrupt when read (as the disk tier's checksum
finds a torn write): the chunk fails as ``integrity:checksum`` and the tier drops it,
in a promotion or in a tier load. A tier load the policy fails fails with the chunks
``fail_tier_load(job)`` names (default: its first tier chunk found corrupt, its copy
dropped); its host chunks' blocks get garbage (a torn copy), its tier chunks' blocks
are never written unless every tier chunk was verified (a bad chunk never reaches an
engine block).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from kvoffload.core.jobs import (
    NO_BLOCK,
    EngineJob,
    JobKind,
    JobResult,
    StepPlan,
    TransferJob,
    WorkerReport,
)
from kvoffload.core.keys import ChunkKey
from kvoffload.core.tiering.routes import (
    FROM_HOST,
    FROM_TIER,
    PROMOTE,
    SPILL,
    TO_HOST,
    Leg,
    Route,
    leg_on,
    legs,
    merge,
)
from kvoffload.engine.block_pool import BlockPool
from kvoffload.engine.manual_tier_legs import TORN, Failures, load_from_tier, promote, spill
from kvoffload.engine.memory_tiers import InvariantViolation, MemoryTiers

__all__ = ["InvariantViolation", "ManualWorker", "PendingJob"]


@dataclass
class PendingJob:
    """A job planned and not reported yet; mutated by its worker only."""

    job: TransferJob
    planned_step: int
    ran: bool = False  # its copy ran (a flush, or the policy picked it)
    runnable: bool = False  # submitted: the policy may pick it


CompletionPolicy = Callable[[int, Sequence[PendingJob]], dict[int, bool]]
Expected = Callable[[EngineJob, int], bytes]  # (job, index of a chunk in it) -> bytes
FailTierLoad = Callable[[EngineJob], Failures]  # a failed tier load's failed chunks


def complete_everything(step: int, jobs: Sequence[PendingJob]) -> dict[int, bool]:
    """The default policy: every runnable job completes successfully at once."""
    return {p.job.job_id: True for p in jobs}


def first_chunk_torn(job: EngineJob) -> Failures:
    """The default failure of a tier load: its first tier chunk is found corrupt."""
    leg = leg_on(job, FROM_TIER)
    assert leg is not None, "a tier load has a leg from its tier"
    return ((leg.chunks[0], TORN),)


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
        fail_tier_load: FailTierLoad = first_chunk_torn,
    ) -> None:
        self.pool = pool
        self.world_size = world_size
        self.policy = policy
        self.expected = expected
        self.fail_tier_load = fail_tier_load
        self.host: list[bytes | None] = [None] * num_slots
        self.host_key: list[ChunkKey | None] = [None] * num_slots
        self.known: dict[ChunkKey, bytes] = {}  # the bytes every verified store captured
        self.pending: dict[int, PendingJob] = {}
        self.newest_job = 0  # the newest job id planned
        self.tiers = MemoryTiers(self.known)  # the in-memory lower tiers
        self.lower = self.tiers.slots  # tier -> tier slot -> (chunk key, bytes, group)
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
            self.newest_job = max(self.newest_job, job.job_id)
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
            results.append(self._complete(self.pending.pop(job_id), success))
        return [WorkerReport(rank, tuple(results)) for rank in range(self.world_size)]

    def _complete(self, pending: PendingJob, success: bool) -> JobResult:
        """Run ``pending`` (unless a flush ran it) with the policy's ``success``; its
        result (a promotion succeeds when some chunk made it, a tier load when all did)."""
        job = pending.job
        if pending.ran:  # a flushed store: its copy ran already
            return JobResult(job.job_id, success, len(job.keys), 0.0)
        return self._run(pending, success)

    def damage(self, tier: str, tier_slot: int) -> None:
        """Tear the chunk in ``tier_slot`` of ``tier``: the next promotion or tier load
        that reads it finds it corrupt (see the module docstring); a spill into the
        slot writes it whole again."""
        self.tiers.damage(tier, tier_slot)

    def applied(self, reports: Sequence[WorkerReport]) -> None:
        """The engine applied ``reports`` to the scheduler half."""
        for report in reports:
            for result in report.results:
                self.unacknowledged.pop(result.job_id, None)
                if result.failed_chunks:
                    self.tiers.acknowledged(result.job_id, self.newest_job)

    # ------------------------------------------------------------ copies

    def _run(self, pending: PendingJob, success: bool) -> JobResult:
        """Run every leg of the job by its route (``_LEGS``) with ``success``; the
        legs' results merged (:func:`~kvoffload.core.tiering.routes.merge`). A job with no
        leg (a load of invalid blocks only) moves nothing and ends as ``success``."""
        job = pending.job
        pending.ran = True
        self.copies += 1
        job_legs = legs(job)
        if not job_legs:
            return JobResult(job.job_id, success, 0, 0.0)
        return merge(job.job_id, [_LEGS[leg.route](self, job, leg, success) for leg in job_legs])

    def _store(self, job: TransferJob, leg: Leg, success: bool) -> JobResult:
        """Engine blocks -> host slots (a failed store leaves garbage in its slots)."""
        assert isinstance(job, EngineJob)
        k = job.blocks_per_chunk
        for i in leg.chunks:
            slot = job.slots[i]
            blocks = job.block_ids[i * k : (i + 1) * k]
            data = b"".join(self.pool.read(b) for b in blocks)
            if not success:
                self.host[slot], self.host_key[slot] = b"\xee" * len(data), None
                continue
            self.verify(job, i, data, "store captured")
            self.host[slot], self.host_key[slot] = data, job.keys[i]
            self.known[job.keys[i]] = data
        return JobResult(job.job_id, success, len(leg.chunks), 0.0)

    def _load_from_host(self, job: TransferJob, leg: Leg, success: bool) -> JobResult:
        """Host slots -> engine blocks (a failed load leaves garbage in its blocks)."""
        assert isinstance(job, EngineJob)
        chunks = {c: self._host_chunk(job, c) for c in leg.chunks if success}
        self.write_blocks(job, chunks, garbage=() if success else leg.chunks)
        return JobResult(job.job_id, success, len(leg.chunks), 0.0)

    def _host_chunk(self, job: EngineJob, chunk: int) -> bytes:
        """The bytes a load reads for its chunk ``chunk`` from its host slot, checked."""
        slot = job.slots[chunk]
        held = self.host[slot]
        if held is None or self.host_key[slot] != job.keys[chunk]:
            raise InvariantViolation(
                f"step {self.step}: load job {job.job_id} reads slot {slot}, which holds "
                f"{'nothing' if held is None else 'another chunk'}"
            )
        self.verify(job, chunk, held, "load read")
        return held

    def write_blocks(
        self, job: EngineJob, chunks: dict[int, bytes], *, garbage: Collection[int]
    ) -> None:
        """Write the load's blocks of the chunks in ``chunks`` (index in the job ->
        bytes), and garbage into the blocks of the chunks in ``garbage`` (a torn
        copy). Other blocks are not written."""
        k, skip, block_bytes = job.blocks_per_chunk, job.skip_blocks, self.pool.block_bytes
        for m, block in enumerate(job.block_ids):
            chunk, index = divmod(m + skip, k)
            if block == NO_BLOCK:
                continue
            data = chunks.get(chunk)
            if data is not None:
                self.pool.write(block, 0, data[index * block_bytes : (index + 1) * block_bytes])
            elif chunk in garbage:
                self.pool.write(block, 0, b"\xdd" * block_bytes)

    def what(self, job: TransferJob) -> str:
        return f"step {self.step}: {job.kind.value} job {job.job_id}"

    def verify(self, job: EngineJob, chunk: int, data: bytes, what: str) -> None:
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


_LEGS: dict[Route, Callable[[ManualWorker, TransferJob, Leg, bool], JobResult]] = {
    FROM_HOST: ManualWorker._load_from_host,
    TO_HOST: ManualWorker._store,
    SPILL: spill,
    PROMOTE: promote,
    FROM_TIER: load_from_tier,
}
"""How each leg runs, by its route."""
