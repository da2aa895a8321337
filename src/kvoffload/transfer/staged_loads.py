"""Tier loads: a load's chunks read from a lower tier into engine blocks, through a
bounded staging area.

A *tier load* (:mod:`kvoffload.core.jobs`) has a leg from a lower tier straight
into engine blocks (route :data:`~kvoffload.core.tiering.routes.FROM_TIER`, see
:func:`kvoffload.core.tiering.routes.legs`). :class:`StagedLoads` moves that leg's chunks; the
job's host leg runs on the main :class:`~kvoffload.transfer.worker.TransferWorker` as
any load's, and :class:`~kvoffload.transfer.step_backend.TransferBackend` merges the
legs' results into the job's one result.

Staging: each tier has a staging area of its own, a :class:`HostSlab` of ``S`` chunk
slots (pinned when the main slab is, so CUDA copies from it are asynchronous), and a
:class:`TransferWorker` over it with the main worker's layout and chunk size, whose
CPU kernel or CUDA streams copy staged chunks into engine blocks. One lane thread per
tier runs that tier's loads one at a time, in submission order (a job's parts reuse
the staging slots; a slow or dead tier delays only its own loads). A job's tier
chunks go in parts of at most ``S``: the tier's ``read_many`` fills the staging slots
and verifies every chunk (format, key, checksum, group); when every chunk of the part
is good, the staging worker copies the part into its engine blocks, and the lane
waits for that copy before it reads the next part. A chunk that fails verification
is never copied into an engine block.

Results (:meth:`StagedLoads.poll`, one per job; the tier chunks only): ``success``
when every tier chunk landed. ``failed_chunks`` (index in the job,
:class:`ChunkFailure`): the chunks the tier found missing or corrupt (the load stops
at the first part that has one: later chunks are neither read nor listed), or, when
the tier raised as a whole (connection refused, timeout), every tier chunk not landed
yet, with ``error_failure``. ``error``: the exception's or the staging copy's text,
else the first failed chunk's failure. ``nbytes``: the block records copied into the
engine; ``seconds``: the job's reads and copies, from the lane's start on it. A job
naming a tier this object has no store for fails at once, every tier chunk with
``error_failure``. Nothing here raises for a failed job.

Ownership: :class:`StagedLoads` owns the staging slabs and workers, its lane threads
and the jobs it accepted until their results were polled; it borrows ``stores`` (the
tier lane's dict, read at each part, so a wrapper put in it is used; the tier lane
closes the stores) and the engine's KV tensors (through the layout). Engine blocks
are written only by the staging copies, of blocks the scheduler half handed to this
load alone.

CUDA: the staging worker is used from its lane thread only (a CUDA worker's calls
must come from one thread); each copy follows the engine stream that was current
when the job was submitted, as a host load follows it.

Deadlines (:mod:`kvoffload.transfer.io_deadlines`): each job is due ``timeout_s``
after its submission. A job still queued or reading at :meth:`StagedLoads.poll` past
its deadline is reported failed at once, every tier chunk with a
:data:`~kvoffload.core.failures.FailureKind.TIMEOUT` failure (the chunks stay in the
tier: not known bad), so the engine recomputes its blocks. Its lane thread may still
be inside the tier's read: the staging slots stay held by that thread (the lane runs
nothing else meanwhile, its later jobs time out in turn from their own submission),
and when the read returns the job's state refuses the copy: nothing reaches the
engine blocks, which the engine has back. A copy in progress is never cut short (the
deadline waits for it; it is local memory). ``io_hook`` (tests, harnesses) is called
on the lane thread with the job before each tier read; it may block (a hung read) or
raise (the tier failed as a whole).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from kvoffload.core.config.options import default
from kvoffload.core.failures import ChunkFailure, error_failure, timeout_failure
from kvoffload.core.jobs import EngineJob, JobResult
from kvoffload.core.tiering.routes import FROM_TIER, Leg, leg_on
from kvoffload.tiers.host import HostSlab
from kvoffload.transfer.io_deadlines import DeadlineBook
from kvoffload.transfer.lanes import Lane
from kvoffload.transfer.results import ResultBook
from kvoffload.transfer.tier_worker import TIMEOUT_S, TierStore
from kvoffload.transfer.worker import TransferWorker

STAGING_BYTES = 16 << 20
"""The staging area of a worker, all tiers together (each tier at least one chunk)."""


IoHook = Callable[[EngineJob], None]


class StagedLoadLane(Protocol):
    """What :class:`~kvoffload.transfer.step_backend.TransferBackend` uses of the
    staged loads (:class:`StagedLoads`, or a harness's wrapper that holds and fails
    them): the tier chunks of tier loads, reported per job as the module says."""

    def submit(self, job: EngineJob) -> None: ...

    def poll(self) -> list[JobResult]: ...

    def running(self) -> set[int]: ...

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> bool: ...

    def quarantined(self) -> set[int]: ...

    def shutdown(self, timeout: float | None = 10.0) -> None: ...


@dataclass(frozen=True)
class _Queued:
    job: EngineJob
    leg: Leg  # the job's leg from its tier into the engine
    stream: torch.cuda.Stream | None  # the engine's stream at submission (CUDA)


@dataclass
class _Outcome:
    """What the lane found so far for one job; mutated by its lane thread only."""

    nbytes: int = 0
    error: str = ""
    failed: tuple[tuple[int, ChunkFailure], ...] = ()


class _Stage:
    """One tier's staging area: the slab's slots are the staging slots, the worker
    copies from them into engine blocks. Owned by :class:`StagedLoads`."""

    def __init__(self, tier: str, worker: TransferWorker) -> None:
        self.tier = tier
        self.worker = worker
        self.slots = worker.slab.num_slots
        self.lane: Lane[_Queued] | None = None


class StagedLoads:
    """The tier chunks of tier loads, one lane per tier (see the module docstring).

    Threads: :meth:`submit`, :meth:`poll`, :meth:`running`, :meth:`wait` and
    :meth:`shutdown` may be called from any thread (the engine's)."""

    def __init__(
        self,
        stages: Sequence[_Stage],
        stores: Mapping[str, TierStore],
        *,
        timeout_s: float = TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        io_hook: IoHook | None = None,
    ) -> None:
        self.stores = stores
        self.io_hook = io_hook
        self._stages = {stage.tier: stage for stage in stages}
        self._book = ResultBook()
        self._deadlines: DeadlineBook[_Queued] = DeadlineBook(timeout_s, clock)
        self._closed = False
        for stage in stages:
            stage.lane = Lane(f"kvoffload-load-{stage.tier}", self._batch_runner(stage))

    @classmethod
    def open(
        cls,
        worker: TransferWorker,
        stores: Mapping[str, TierStore],
        *,
        staging_bytes: int = STAGING_BYTES,
        threads: int = default("copy_threads"),
        timeout_s: float = TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        io_hook: IoHook | None = None,
    ) -> StagedLoads:
        """A staging area for each tier of ``stores``: ``staging_bytes`` split between
        them (at least one chunk each), slabs pinned like ``worker``'s, staging workers
        over ``worker``'s layout with ``threads`` copy threads (CPU); jobs due
        ``timeout_s`` after submission on ``clock``. Allocates ``len(stores)`` slabs
        at once; raises what the allocation raises."""
        chunk = worker.slab.chunk_bytes
        per_tier = max(chunk, staging_bytes // max(1, len(stores)))
        stages = []
        for tier in stores:
            slab = HostSlab(chunk, per_tier - per_tier % chunk, pin_memory=worker.slab.pinned)
            staging = TransferWorker(
                worker.layout, slab, worker.blocks_per_chunk, threads=threads, rank=worker.rank,
                codec=worker.codec,
            )  # fmt: skip
            stages.append(_Stage(tier, staging))
        return cls(stages, stores, timeout_s=timeout_s, clock=clock, io_hook=io_hook)

    @property
    def staging_slots(self) -> dict[str, int]:
        """Each tier's staging slots (``S``: the most chunks of one part)."""
        return {tier: stage.slots for tier, stage in self._stages.items()}

    def submit(self, job: EngineJob) -> None:
        """Queue the chunks of ``job``'s leg from a tier on that tier's lane; a job
        without such a leg, naming a tier without a store here, or submitted after
        :meth:`shutdown`, fails at once."""
        self._book.begin(job.job_id)
        leg = leg_on(job, FROM_TIER)
        tier = leg.tier if leg is not None else None
        stage = self._stages.get(tier or "")
        if leg is None or stage is None or stage.lane is None or tier not in self.stores:
            self._fail_all(job, leg, f"no tier {tier!r} on this worker")
            return
        if self._closed:
            self._fail_all(job, leg, "worker is shut down")
            return
        cuda = stage.worker.layout.device
        stream = torch.cuda.current_stream(cuda) if cuda.type == "cuda" else None
        queued = _Queued(job, leg, stream)
        self._deadlines.add(job.job_id, queued)
        if not stage.lane.put(queued):
            self._deadlines.finish(job.job_id)
            self._fail_all(job, leg, "worker is shut down")

    def poll(self) -> list[JobResult]:
        """Results of the jobs finished since the previous poll, in finishing order;
        first, every job past its deadline is reported failed (see the module
        docstring)."""
        for queued in self._deadlines.expire():
            self._time_out(queued)
        self._deadlines.take_returned()  # nothing to tell: the staging slots are the lane's
        return self._book.take()

    def quarantined(self) -> set[int]:
        """Ids of the jobs reported at their deadline whose read has not returned
        (their lane's staging slots are still the read's)."""
        return self._deadlines.quarantined()

    @property
    def staging_workers(self) -> dict[str, TransferWorker]:
        """Each tier's staging worker (read-only use: harness checks of its copies)."""
        return {tier: stage.worker for tier, stage in self._stages.items()}

    def running(self) -> set[int]:
        """Ids of the jobs submitted and not finished yet."""
        return self._book.running()

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> bool:
        """Block until the given jobs finished (False: ``timeout`` passed first);
        unknown or reported ids are fine. Results stay queued for :meth:`poll`."""
        return self._book.wait(job_ids, timeout)

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stop: queued jobs fail (cancelled), a running job fails before its next
        part (abandoned), or past ``timeout`` at once (its late result is dropped and
        its thread left to end on its own, as a read past its deadline is).
        Idempotent; never raises; the stores stay open (the tier lane closes them)."""
        self._closed = True
        for stage in self._stages.values():
            if stage.lane is not None:
                for queued in stage.lane.close():
                    self._deadlines.finish(queued.job.job_id)  # never started: no I/O
                    self._book.fail(queued.job.job_id, "cancelled: worker shut down")
        if not self._book.wait(self._book.running(), timeout):
            for job_id in self._book.running():
                self._book.fail(job_id, "abandoned: still running at shutdown")
            return  # a lane may still be reading or copying: leave its stage alone
        if self._deadlines.quarantined():
            return  # a read past its deadline has not returned: leave its stage alone
        for stage in self._stages.values():
            if stage.lane is not None:
                stage.lane.join()
            stage.worker.shutdown(timeout)

    # ------------------------------------------------------------ the lane thread

    def _batch_runner(self, stage: _Stage) -> Callable[[list[_Queued]], None]:
        def run(batch: list[_Queued]) -> None:
            for queued in batch:
                self._run(stage, queued)

        return run

    def _run(self, stage: _Stage, queued: _Queued) -> None:
        """Lane thread: read, verify and copy the job's tier chunks part by part, then
        report the job, unless it timed out meanwhile (never raises)."""
        job, begin = queued.job, time.perf_counter()
        chunks = queued.leg.chunks
        outcome = _Outcome()
        if not self._deadlines.begin_io(job.job_id):  # timed out while queued
            self._deadlines.finish(job.job_id)
            return
        for lo in range(0, len(chunks), stage.slots):
            if self._closed:
                outcome.error = "abandoned: worker shut down during the load"
                break
            if not self._part(stage, queued, lo, chunks, outcome):
                break
        if not self._deadlines.finish(job.job_id):
            return  # reported at its deadline; its staging slots are free again now
        self._book.finish(
            JobResult(
                job.job_id,
                success=not (outcome.error or outcome.failed),
                nbytes=outcome.nbytes,
                seconds=time.perf_counter() - begin,
                error=outcome.error or (outcome.failed[0][1] if outcome.failed else ""),
                failed_chunks=outcome.failed,
            )
        )

    def _part(
        self,
        stage: _Stage,
        queued: _Queued,
        lo: int,
        chunks: tuple[int, ...],
        outcome: _Outcome,
    ) -> bool:
        """Read chunks ``chunks[lo:lo + S]`` into the staging slots and, all good and
        the job not timed out, copy them into their engine blocks; False (``outcome``
        says why) to stop."""
        job = queued.job
        batch = chunks[lo : lo + stage.slots]
        hi = lo + len(batch)
        try:
            store = self.stores[queued.leg.source.name]
            views = [stage.worker.slab.slot_bytes(s) for s in range(len(batch))]
            keys = [job.keys[c] for c in batch]
            if self.io_hook is not None:
                self.io_hook(job)
            failures = store.read_many(keys, job.tier_slots[lo:hi], views, job.groups[lo:hi])
            bad = tuple(
                (c, failure)
                for c, failure in zip(batch, failures, strict=True)
                if failure is not None
            )
        except Exception as exc:  # the tier failed as a whole: every chunk not landed
            outcome.error = f"{type(exc).__name__}: {exc}"
            failure = error_failure(outcome.error)
            outcome.failed = tuple((c, failure) for c in chunks[lo:])
            return False
        if bad:
            outcome.failed = bad
            return False
        part = job.part(batch, range(len(batch)))
        if not part.moved_blocks():  # every block of these chunks is left out
            return True
        if not self._deadlines.begin_copy(job.job_id):
            return False  # the read came back after the deadline: its blocks are vLLM's
        try:
            return self._copy(stage, queued, part, outcome)
        finally:
            self._deadlines.end_copy(job.job_id)

    def _copy(self, stage: _Stage, queued: _Queued, part: EngineJob, outcome: _Outcome) -> bool:
        """Copy a staged part into its engine blocks and wait for it."""
        job_id = part.job_id
        with _following(queued.stream):
            stage.worker.submit_load(part)
        stage.worker.wait([job_id])
        copied = [r for r in stage.worker.poll() if r.job_id == job_id]
        if not copied or not copied[0].success:
            outcome.error = str(copied[0].error) if copied else "staging copy not reported"
            return False
        outcome.nbytes += copied[0].nbytes
        return True

    def _time_out(self, queued: _Queued) -> None:
        """Report a job failed at its deadline: every chunk of its leg TIMEOUT."""
        job = queued.job
        failure = timeout_failure(f"tier read past {self._deadlines.timeout_s:g} s")
        failed = tuple((c, failure) for c in queued.leg.chunks)
        timeout_s = self._deadlines.timeout_s  # it ran at least that long
        self._book.finish(
            JobResult(job.job_id, False, seconds=timeout_s, error=failure, failed_chunks=failed)
        )

    def _fail_all(self, job: EngineJob, leg: Leg | None, error: str) -> None:
        failure = error_failure(error)
        failed = tuple((c, failure) for c in (leg.chunks if leg is not None else ()))
        self._book.finish(JobResult(job.job_id, False, error=error, failed_chunks=failed))


@contextlib.contextmanager
def _following(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Make ``stream`` (the engine's, on CUDA) this thread's current stream, which a
    CUDA load waits for; nothing on CPU."""
    if stream is None:
        yield
        return
    with torch.cuda.stream(stream):
        yield
