"""A copy lane: one thread running queued jobs in submission order.

One per copy direction of a :class:`~kvoffload.transfer.worker.TransferWorker`, and
one per tier of :class:`~kvoffload.transfer.staged_loads.StagedLoads` (its items:
tier loads with the engine stream they follow).

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
from typing import Generic, TypeVar

from kvoffload.transfer.threads import single_threaded_torch

T = TypeVar("T")


class Lane(Generic[T]):
    def __init__(self, name: str, run_batch: Callable[[list[T]], None]) -> None:
        self._run_batch = run_batch
        self._cv = threading.Condition()
        self._queue: list[T] = []
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def put(self, job: T) -> bool:
        """Queue ``job``; False if the lane is closed (the job will not run)."""
        with self._cv:
            if self._closed:
                return False
            self._queue.append(job)
            self._cv.notify()
            return True

    def close(self) -> list[T]:
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
