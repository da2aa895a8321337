"""The worker's tier lane: spill and promote jobs between host slots and lower tiers.

One per model worker, next to the :class:`~kvoffload.transfer.worker.TransferWorker`
(which moves engine blocks <-> host slots). A spill job writes its host slots to a
tier under its keys (at its tier slots, for a slotted tier); a promote job reads
chunks from a tier, verified, into its host slots. Each job runs on a small thread pool (tier I/O
blocks: disks, networks), so a slow tier delays only its own jobs; a large job is
split into parts of about ``part_bytes`` that run in parallel.

Results follow :class:`~kvoffload.core.jobs.JobResult` (``nbytes``: the bytes of the
chunks that made it as the tier keeps them, where a store through codecs says so,
``transfer/tier_codecs.py``; else as host slots hold them): a chunk that failed inside
a job is listed in ``failed_chunks`` with its
:class:`~kvoffload.core.failures.ChunkFailure` (a part of the job whose tier call
raised fails each of its chunks with ``FailureKind.ERROR``); a job none of whose
chunks made it has ``success=False`` and as ``error`` the exception's text (the tier
raised: connection refused, timeout) or else its first chunk's failure. Nothing here
raises into the engine. The scheduler half pins spilled slots and reserves promoted
ones, so no other job touches them meanwhile.

Deadlines (:mod:`kvoffload.transfer.io_deadlines`): each job is due ``timeout_s``
after its submission. A job still queued or running at :meth:`TierWorker.poll` past
its deadline is reported failed at once, every chunk with a
:data:`~kvoffload.core.failures.FailureKind.TIMEOUT` failure; a part not started yet
then never starts. Its threads may still be inside the tier call, reading the job's
host slots (a spill) or writing them (a promotion): the job is *quarantined* until
they come back, and then its id is handed out once by :meth:`TierWorker.take_returned`
(reported to the scheduler half as :attr:`~kvoffload.core.jobs.WorkerReport.released`),
which keeps those slots reserved until then. ``io_hook`` (tests, harnesses) is called
on the pool thread with the job before each tier call; it may block (a hung call) or
raise (the tier failed as a whole).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from kvoffload.core.config.options import default
from kvoffload.core.failures import ChunkFailure, error_failure, timeout_failure
from kvoffload.core.jobs import JobKind, JobResult, TierJob
from kvoffload.tiers.slot_rows import SlotRows
from kvoffload.tiers.spec import TierStore
from kvoffload.transfer.io_deadlines import DeadlineBook, IoPhase
from kvoffload.transfer.results import ResultBook

__all__ = ["TierLane", "TierStore", "TierWorker"]


class TierLane(Protocol):
    """What the worker's connector role uses of a tier lane (:class:`TierWorker`, or a
    harness's wrapper that holds and fails jobs)."""

    def submit(self, job: TierJob) -> None: ...

    def poll(self) -> list[JobResult]: ...

    def running(self) -> set[int]: ...

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> bool: ...

    def take_returned(self) -> list[int]: ...

    def quarantined(self) -> set[int]: ...

    def shutdown(self, timeout: float | None = 10.0) -> None: ...


TIMEOUT_S = default("tier_io_timeout_ms") / 1000
"""A job's deadline after its submission, by default (``tier_io_timeout_ms``, in s)."""
IoHook = Callable[[TierJob], None]

PART_BYTES = 8 << 20  # a job is split into parts of about this size, run in parallel


class _Parts:
    """The parts of one job in flight; the last part to finish reports the job."""

    def __init__(self, job: TierJob, count: int, begin: float) -> None:
        self.job = job
        self.begin = begin
        self.left = count
        self.failures: dict[int, ChunkFailure] = {}
        self.error = ""
        self.moved: int | None = None  # bytes at the tier (a store through codecs)
        self.lock = threading.Lock()


class TierWorker:
    def __init__(
        self,
        slab: SlotRows,
        stores: dict[str, TierStore],
        *,
        threads: int = default("tier_threads"),
        part_bytes: int = PART_BYTES,
        timeout_s: float = TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        io_hook: IoHook | None = None,
    ):
        self.slab = slab
        self.stores = stores
        self.io_hook = io_hook
        self.part_chunks = max(1, part_bytes // max(1, slab.chunk_bytes))
        self._book = ResultBook()
        self._deadlines: DeadlineBook[TierJob] = DeadlineBook(timeout_s, clock)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvoffload-tier")
        self._closed = False

    def submit(self, job: TierJob) -> None:
        """Start a spill or promote job (a bad job becomes a failed result)."""
        self._book.begin(job.job_id)
        if self._closed or job.tier not in self.stores:
            self._book.fail(job.job_id, f"cannot run {job.kind.value} job on tier {job.tier!r}")
            return
        self._deadlines.add(job.job_id, job)
        try:
            self._pool.submit(self._start, job)
        except RuntimeError as exc:
            self._deadlines.finish(job.job_id)
            self._book.fail(job.job_id, f"worker is shut down: {exc}")

    def poll(self) -> list[JobResult]:
        """Results finished since the previous poll; first, every job past its
        deadline is reported failed (see the module docstring)."""
        for job in self._deadlines.expire():
            failure = timeout_failure(f"tier {job.kind.value} past {self._deadlines.timeout_s:g} s")
            failed = tuple((i, failure) for i in range(len(job.keys)))
            timeout_s = self._deadlines.timeout_s  # it ran at least that long
            self._book.finish(
                JobResult(job.job_id, False, seconds=timeout_s, error=failure, failed_chunks=failed)
            )
        return self._book.take()

    def take_returned(self) -> list[int]:
        """Ids of jobs reported at their deadline whose threads all came back since
        the last call: the host slots they read or wrote are free again."""
        return self._deadlines.take_returned()

    def quarantined(self) -> set[int]:
        """Ids of jobs reported at their deadline whose threads have not come back."""
        return self._deadlines.quarantined()

    def running(self) -> set[int]:
        """Ids of the jobs submitted and not finished yet."""
        return self._book.running()

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> bool:
        return self._book.wait(job_ids, timeout)

    def shutdown(self, timeout: float | None = 10.0) -> None:
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        if not self._book.wait(self.running(), timeout):
            for job_id in self.running():
                self._book.fail(job_id, "abandoned: still running at shutdown")
            return  # a thread may still use its store: leave the files open
        if self.quarantined():
            return  # a call past its deadline has not returned: leave the files open
        for store in self.stores.values():
            close = getattr(store, "close", None)
            if close is not None:
                close()

    def _start(self, job: TierJob) -> None:
        """Run the job's parts: the first here, the others on the pool (the last one
        to finish reports)."""
        begin = time.perf_counter()
        n = len(job.keys)
        bounds = [(i, min(i + self.part_chunks, n)) for i in range(0, n, self.part_chunks)]
        parts = _Parts(job, max(1, len(bounds)), begin)
        if not self._deadlines.begin_io(job.job_id):  # timed out while queued
            self._deadlines.finish(job.job_id)
            return
        if not bounds:
            self._finish(parts)
            return
        for lo, hi in bounds[1:]:
            try:
                self._pool.submit(self._run_part, parts, lo, hi)
            except RuntimeError:  # shut down meanwhile: run it here
                self._run_part(parts, lo, hi)
        self._run_part(parts, *bounds[0])

    def _run_part(self, parts: _Parts, lo: int, hi: int) -> None:
        job = parts.job
        store = self.stores[job.tier]
        failures: list[ChunkFailure | None] = []
        error = ""
        moved: int | None = None
        try:
            if self._deadlines.phase(job.job_id) is IoPhase.TIMED_OUT:
                raise TimeoutError("past its deadline before this part started")
            if self.io_hook is not None:
                self.io_hook(job)
            views = [self.slab.slot_bytes(slot) for slot in job.slots[lo:hi]]
            keys, tier_slots, groups = job.keys[lo:hi], job.tier_slots[lo:hi], job.groups[lo:hi]
            if job.kind is JobKind.SPILL:
                items = list(zip(keys, views, strict=True))
                failures = store.write_many(items, tier_slots, groups)
            else:
                failures = store.read_many(keys, tier_slots, views, groups)
            last_moved = getattr(store, "last_moved", None)  # a store through codecs
            moved = last_moved() if last_moved is not None else None
        except Exception as exc:  # the tier failed as a whole: every chunk of the part
            error = f"{type(exc).__name__}: {exc}"
        with parts.lock:
            if error:
                parts.error = parts.error or error
                failure = error_failure(error)
                parts.failures.update((i, failure) for i in range(lo, hi))
            else:
                parts.failures.update(
                    (lo + i, reason) for i, reason in enumerate(failures) if reason is not None
                )
                if moved is not None:
                    parts.moved = (parts.moved or 0) + moved
            parts.left -= 1
            last = parts.left == 0
        if last:
            self._finish(parts)

    def _finish(self, parts: _Parts) -> None:
        job = parts.job
        if not self._deadlines.finish(job.job_id):
            return  # reported at its deadline; take_returned hands its id out now
        failed = tuple(sorted(parts.failures.items(), key=lambda item: item[0]))
        done = len(job.keys) - len(failed)
        self._book.finish(
            JobResult(
                job.job_id,
                success=done > 0 or not job.keys,
                nbytes=done * self.slab.chunk_bytes if parts.moved is None else parts.moved,
                seconds=time.perf_counter() - parts.begin,
                error=_job_error(parts.error, failed) if not done else "",
                failed_chunks=failed if done else (),
            )
        )


def _job_error(text: str, failed: tuple[tuple[int, ChunkFailure], ...]) -> str | ChunkFailure:
    """A failed job's ``error``: the text of a tier call that raised, else the first
    chunk's failure (none: no chunk at all)."""
    if text:
        return text
    return failed[0][1] if failed else ""
