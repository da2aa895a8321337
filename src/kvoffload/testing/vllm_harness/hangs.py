"""Tier I/O that hangs inside its job until the harness lets it return.

:class:`IoHangs` is every rank's ``io_hook`` (see
:class:`~kvoffload.adapters.vllm.worker_side.WorkerSide`): the real tier lane and
staged loads call it on their thread right before each tier call. A job armed for a
rank (:meth:`IoHangs.arm`) parks its first call there, inside its deadline, until
:meth:`IoHangs.release`; then the real call runs, late, into the memory the job was
given (host slots, staging slots). Its deadline fires meanwhile on the harness's
logical clock, so the worker reports it failed while its thread is still out.

:func:`settle` replaces waiting for a lane's jobs when some may be parked: it returns
once every job the lane accepted finished (reported, or came back after its
deadline), or the lane's thread is parked (every later job of the lane waits behind
it: a tier's staged loads run on one thread in order; the harness runs the tier lane
with one thread when it hangs I/O, which makes that lane ordered too). The outcome
depends only on what was released, never on timing; the short waits in the loop
only re-check the condition.

Counts: ``parked_total`` calls parked so far. Thread-safe (one condition).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from kvoffload.core.jobs import EngineJob, TierJob, TransferJob
from kvoffload.testing.vllm_harness.gates import GatedTiers
from kvoffload.transfer.staged_loads import StagedLoads

RECHECK_S = 0.002


class IoHangs:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._armed: set[tuple[int, int]] = set()  # (rank, job id): its next call parks
        self._parked: dict[tuple[int, int], tuple[threading.Event, str]] = {}
        self._open = False  # closing: nothing parks any more
        self.parked_total = 0

    def hook(self, rank: int) -> Callable[[TransferJob], None]:
        """Rank ``rank``'s ``io_hook``."""

        def io_hook(job: TransferJob) -> None:
            key = (rank, job.job_id)
            with self._cv:
                if self._open or key not in self._armed:
                    return
                self._armed.discard(key)
                go = threading.Event()
                self._parked[key] = (go, threading.current_thread().name)
                self.parked_total += 1
                self._cv.notify_all()
            go.wait()
            with self._cv:
                self._parked.pop(key, None)
                self._cv.notify_all()

        return io_hook

    def arm(self, rank: int, job_id: int) -> None:
        """The job's next tier call on ``rank`` parks (call before it is submitted)."""
        with self._cv:
            if not self._open:
                self._armed.add((rank, job_id))

    def parked(self, rank: int) -> list[int]:
        """Ids of the jobs with a call parked on ``rank``."""
        with self._cv:
            return sorted(job_id for r, job_id in self._parked if r == rank)

    def release(self, rank: int, job_ids: Iterable[int]) -> None:
        """Let the parked calls of ``job_ids`` on ``rank`` return."""
        with self._cv:
            for job_id in job_ids:
                parked = self._parked.get((rank, job_id))
                if parked is not None:
                    parked[0].set()

    def release_all(self) -> None:
        """Let every parked call return, and park nothing from now on (shutdown)."""
        with self._cv:
            self._open = True
            self._armed.clear()
            for go, _ in self._parked.values():
                go.set()

    def thread_parked(self, rank: int, prefix: str) -> bool:
        """Whether a thread whose name starts with ``prefix`` is parked on ``rank``."""
        with self._cv:
            parked = self._parked.items()
            return any(r == rank and name.startswith(prefix) for (r, _), (_, name) in parked)

    def recheck(self) -> None:
        """Wait a moment for a call to park or return (the caller re-checks)."""
        with self._cv:
            self._cv.wait(RECHECK_S)


def settle(lane: GatedTiers[TierJob] | GatedTiers[EngineJob], rank: int, hangs: IoHangs) -> None:
    """Return once ``lane``'s accepted jobs all finished, or its thread is parked."""
    prefix = "kvoffload-load-" if isinstance(lane.inner, StagedLoads) else "kvoffload-tier"
    inner = lane.inner
    while True:
        if hangs.thread_parked(rank, prefix):
            return
        running = inner.running()
        if not running and not inner.quarantined():
            return
        if running:
            inner.wait(running, RECHECK_S)
        else:
            hangs.recheck()
