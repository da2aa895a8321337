"""Deadlines of a worker's tier I/O jobs: one small state machine per job.

Every job a tier lane (:class:`~kvoffload.transfer.tier_worker.TierWorker`) or the
staged loads (:class:`~kvoffload.transfer.staged_loads.StagedLoads`) accept gets a
deadline, ``timeout_s`` after its submission, read from an injectable clock (a
harness runs in logical time). Its phase (:class:`IoPhase`) moves only along
:data:`TRANSITIONS`:

- ``QUEUED -> IO``: its thread starts the tier I/O (:meth:`DeadlineBook.begin_io`);
- ``IO -> COPYING -> IO``: a tier load's read returned in time and its staged chunks
  are being copied into engine blocks (:meth:`begin_copy`, :meth:`end_copy`);
- ``QUEUED | IO | COPYING -> DONE``: its thread finished it and reports it
  (:meth:`finish` answers True);
- ``QUEUED | IO -> TIMED_OUT``: the deadline passed (:meth:`expire`, at the owner's
  poll): the owner reports the job failed now (``FailureKind.TIMEOUT``). Its thread
  may still be inside the tier call, writing the job's host or staging slots or
  reading them: that memory is *quarantined* (held, never handed to another job)
  until the thread comes back;
- ``TIMED_OUT -> RETURNED``: its thread came back (:meth:`finish` answers False: the
  result was reported already; :meth:`begin_io` and :meth:`begin_copy` answer False
  first, so a job that timed out neither starts its I/O nor copies anything into an
  engine block); the id is handed out once by :meth:`take_returned`.

``COPYING`` cannot time out: the deadline waits for a copy into engine blocks (local
memory, short), so an engine block is never written after its job was reported.
DONE and RETURNED jobs leave the book. A move outside the table raises
:class:`~kvoffload.core.errors.IllegalTransition` (a bug of the caller).

Thread-safe: one lock; the lane threads move jobs forward, the owner's poll expires
them. Owned by one lane; ``J`` is whatever the owner keeps with a job (the job).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvoffload.core.errors import IllegalTransition

J = TypeVar("J")


class IoPhase(enum.Enum):
    QUEUED = "queued"  # submitted, its tier I/O not started
    IO = "io"  # its tier I/O is running
    COPYING = "copying"  # a tier load copies staged chunks into engine blocks
    DONE = "done"  # its thread finished and reports it
    TIMED_OUT = "timed_out"  # reported failed at its deadline; its I/O may still run
    RETURNED = "returned"  # timed out, and its thread came back: its memory is free


_P = IoPhase
TRANSITIONS: dict[tuple[IoPhase, IoPhase], str] = {
    (_P.QUEUED, _P.IO): "its thread starts the tier I/O",
    (_P.IO, _P.COPYING): "a tier load's read returned in time: copy into engine blocks",
    (_P.COPYING, _P.IO): "the copy of a part finished: the next part's read",
    (_P.QUEUED, _P.DONE): "finished without I/O (nothing to read, shut down)",
    (_P.IO, _P.DONE): "its thread finished it",
    (_P.COPYING, _P.DONE): "its last copy finished",
    (_P.QUEUED, _P.TIMED_OUT): "the deadline passed before it started",
    (_P.IO, _P.TIMED_OUT): "the deadline passed during its tier I/O",
    (_P.TIMED_OUT, _P.RETURNED): "its thread came back after the deadline",
}


@dataclass
class _Entry(Generic[J]):
    job: J
    deadline: float
    phase: IoPhase = IoPhase.QUEUED


class DeadlineBook(Generic[J]):
    """The deadlines and phases of one lane's jobs (see the module docstring)."""

    def __init__(self, timeout_s: float, clock: Callable[[], float]) -> None:
        self.timeout_s = timeout_s
        self.clock = clock
        self._lock = threading.Lock()
        self._entries: dict[int, _Entry[J]] = {}
        self._returned: list[int] = []

    def add(self, job_id: int, job: J) -> None:
        """A job submitted now: QUEUED, due ``timeout_s`` from now."""
        with self._lock:
            self._entries[job_id] = _Entry(job, self.clock() + self.timeout_s)

    def begin_io(self, job_id: int) -> bool:
        """QUEUED -> IO; False (nothing moves) when the job timed out meanwhile: its
        thread must not start the I/O, and then calls :meth:`finish`."""
        return self._advance(job_id, IoPhase.IO)

    def begin_copy(self, job_id: int) -> bool:
        """IO -> COPYING; False when the job timed out during its read: nothing may be
        copied into its engine blocks (the engine has them back)."""
        return self._advance(job_id, IoPhase.COPYING)

    def end_copy(self, job_id: int) -> None:
        """COPYING -> IO (the next part's read; a copy cannot time out)."""
        self._advance(job_id, IoPhase.IO)

    def finish(self, job_id: int) -> bool:
        """The job's thread is done with it: True (DONE) when it reports the result,
        False (RETURNED) when the result was reported at the deadline; either way the
        job leaves the book. An unknown id answers False."""
        with self._lock:
            entry = self._entries.pop(job_id, None)
            if entry is None:
                return False
            if entry.phase is IoPhase.TIMED_OUT:
                self._check(entry.phase, IoPhase.RETURNED)
                self._returned.append(job_id)
                return False
            self._check(entry.phase, IoPhase.DONE)
            return True

    def expire(self) -> list[J]:
        """Time out every QUEUED or IO job past its deadline; the jobs, for their
        owner to report failed. COPYING jobs wait for their copy."""
        now = self.clock()
        out: list[J] = []
        with self._lock:
            for entry in self._entries.values():
                if now >= entry.deadline and entry.phase in (IoPhase.QUEUED, IoPhase.IO):
                    entry.phase = IoPhase.TIMED_OUT
                    out.append(entry.job)
        return out

    def take_returned(self) -> list[int]:
        """Ids of timed-out jobs whose thread came back since the last call."""
        with self._lock:
            returned, self._returned = self._returned, []
            return returned

    def quarantined(self) -> set[int]:
        """Ids of the jobs timed out whose thread has not come back."""
        with self._lock:
            return {i for i, e in self._entries.items() if e.phase is IoPhase.TIMED_OUT}

    def phase(self, job_id: int) -> IoPhase | None:
        """The job's phase (None: not in the book)."""
        with self._lock:
            entry = self._entries.get(job_id)
            return None if entry is None else entry.phase

    def _advance(self, job_id: int, new: IoPhase) -> bool:
        with self._lock:
            entry = self._entries.get(job_id)
            if entry is None or entry.phase is IoPhase.TIMED_OUT:
                return False
            self._check(entry.phase, new)
            entry.phase = new
            return True

    @staticmethod
    def _check(old: IoPhase, new: IoPhase) -> None:
        if (old, new) not in TRANSITIONS:
            raise IllegalTransition(f"tier I/O job: {old.name} -> {new.name}")
