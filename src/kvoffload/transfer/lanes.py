"""A copy lane: one direction's thread, running queued jobs in submission order.

When the thread wakes it takes *every* job queued so far as one batch, so a step's
worth of jobs costs one wake-up and (see :class:`~kvoffload.transfer.worker.
TransferWorker`) one copy pass instead of one per job. ``close`` refuses new jobs and
hands back the ones that never started; the batch running finishes.

``run_batch`` is called on the lane's thread and must not raise (it turns every
problem into failed results).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from kvoffload.core.jobs import EngineJob
from kvoffload.transfer.threads import single_threaded_torch

RunBatch = Callable[[list[EngineJob]], None]


class Lane:
    def __init__(self, name: str, run_batch: RunBatch) -> None:
        self._run_batch = run_batch
        self._cv = threading.Condition()
        self._queue: list[EngineJob] = []
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def put(self, job: EngineJob) -> bool:
        """Queue ``job``; False if the lane is closed (the job will not run)."""
        with self._cv:
            if self._closed:
                return False
            self._queue.append(job)
            self._cv.notify()
            return True

    def close(self) -> list[EngineJob]:
        """Stop taking jobs; return the queued ones that will never run."""
        with self._cv:
            self._closed = True
            dropped, self._queue = self._queue, []
            self._cv.notify()
            return dropped

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the running batch; False if ``timeout`` passed first."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _loop(self) -> None:
        single_threaded_torch()
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._queue) or self._closed)
                if not self._queue:
                    return
                batch, self._queue = self._queue, []
            self._run_batch(batch)
