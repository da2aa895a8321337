"""Bookkeeping of submitted jobs until their results are polled.

A job is *running* from :meth:`ResultBook.begin` until its first
:meth:`ResultBook.finish`, then *finished* until :meth:`ResultBook.take` hands its
result out. Every begun job is finished and taken exactly once: a second ``finish``
of the same id (a copy that completes after shutdown gave up on it) is dropped.

Thread-safe: copy threads finish jobs while the engine thread begins, waits and
takes. The book is owned by one :class:`~kvoffload.transfer.worker.TransferWorker`.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable

from kvoffload.core.errors import ContractViolation
from kvoffload.core.jobs import JobResult


class ResultBook:
    """Running and finished-but-unpolled jobs of one worker (see the module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running: set[int] = set()
        self._finished: list[JobResult] = []
        self._awaited: Counter[int] = Counter()  # ids some wait() blocks on

    def begin(self, job_id: int) -> None:
        """Record ``job_id`` as running. A job id already running is a caller bug."""
        with self._cond:
            if job_id in self._running:
                raise ContractViolation(f"job {job_id} is already in flight")
            self._running.add(job_id)

    def finish(self, result: JobResult) -> bool:
        """Record ``result``; False (and dropped) if its job is not running."""
        with self._cond:
            if result.job_id not in self._running:
                return False
            self._running.discard(result.job_id)
            self._finished.append(result)
            if result.job_id in self._awaited:  # wake waiters only when it matters
                self._cond.notify_all()
            return True

    def fail(self, job_id: int, error: str) -> bool:
        """Finish ``job_id`` as failed with ``error``."""
        return self.finish(JobResult(job_id, success=False, error=error))

    def take(self) -> list[JobResult]:
        """Every result finished since the previous call, in finishing order."""
        with self._cond:
            taken, self._finished = self._finished, []
            return taken

    def running(self) -> set[int]:
        with self._cond:
            return set(self._running)

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> bool:
        """Block until none of ``job_ids`` is running; False if ``timeout`` passed first.

        Ids never begun or already finished count as finished.
        """
        wanted = set(job_ids)
        with self._cond:
            self._awaited.update(wanted)
            try:
                return self._cond.wait_for(lambda: not (wanted & self._running), timeout)
            finally:
                self._awaited.subtract(wanted)
                self._awaited += Counter()  # drop ids no one waits for
