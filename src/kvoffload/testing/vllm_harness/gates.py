"""Transfers that complete, fail or hang only when the harness says so.

:class:`CopyGate` is a worker's copy hook: every engine<->host copy waits in it until
released (or failed). Each direction's lane runs its jobs in submission order, so a
release also releases the jobs submitted before it in that lane (a held job would
hold them anyway): what is released can always be waited for. :class:`GatedTiers`
stands in for a worker's tier lane and holds spill and promote jobs before they
start, or for its staged loads and holds tier loads' tier halves before they start
(their host halves are copies, held by the copy gate); :class:`TornWrites` wraps a
tier store so chosen chunks are written damaged while the write reports success (a
torn write, found by the reader's checksum).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Generic, Protocol, TypeVar

from kvoffload.core.failures import ChunkFailure, error_failure
from kvoffload.core.jobs import EngineJob, JobKind, JobResult, TierJob
from kvoffload.core.keys import ChunkKey
from kvoffload.tiers.disk import PAYLOAD_OFFSET
from kvoffload.tiers.disk_store import DiskTierStore

J = TypeVar("J", bound=TierJob | EngineJob)
J_contra = TypeVar("J_contra", bound=TierJob | EngineJob, contravariant=True)


class JobLane(Protocol[J_contra]):
    """A lane GatedTiers stands in front of: a worker's tier lane
    (:class:`~kvoffload.transfer.tier_worker.TierLane`, of tier jobs) or its staged
    loads (:class:`~kvoffload.transfer.staged_loads.StagedLoadLane`, of tier loads)."""

    def submit(self, job: J_contra) -> None: ...

    def poll(self) -> list[JobResult]: ...

    def running(self) -> set[int]: ...

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> bool: ...

    def quarantined(self) -> set[int]: ...

    def shutdown(self, timeout: float | None = 10.0) -> None: ...


class CopyGate:
    """A copy hook holding every job until :meth:`release` or :meth:`fail`."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._allowed: set[int] = set()
        self._failing: set[int] = set()
        self._open = False
        self._lanes: dict[JobKind, list[int]] = {JobKind.STORE: [], JobKind.LOAD: []}
        self._kind: dict[int, JobKind] = {}

    def submitted(self, job: EngineJob) -> None:
        """Record ``job``'s place in its lane (call when the worker submits it). A job
        released or failed before it was submitted (a store this very step flushes)
        releases the jobs before it in its lane now, as :meth:`release` would have."""
        with self._cv:
            lane = self._lanes[job.kind]
            if job.job_id in self._allowed or job.job_id in self._failing:
                self._allowed.update(lane)
                self._cv.notify_all()
            lane.append(job.job_id)
            self._kind[job.job_id] = job.kind

    def __call__(self, job: EngineJob) -> None:
        with self._cv:
            self._cv.wait_for(
                lambda: self._open or job.job_id in self._allowed or job.job_id in self._failing
            )
            fail = job.job_id in self._failing and not self._open
            self._forget(job.job_id)
        if fail:
            raise RuntimeError(f"injected failure of job {job.job_id}")

    def release(self, job_ids: Iterable[int]) -> set[int]:
        """Let ``job_ids`` (and the jobs before them in their lanes) run; returns
        every id released. Ids not submitted yet are let through when they come."""
        with self._cv:
            released = self._with_predecessors(job_ids)
            self._allowed |= released
            self._cv.notify_all()
            return released

    def fail(self, job_ids: Iterable[int]) -> set[int]:
        """Make ``job_ids`` fail when they reach the copy (their lane predecessors are
        released); returns every id that will finish."""
        with self._cv:
            ids = set(job_ids)
            released = self._with_predecessors(ids)
            self._failing |= ids
            self._allowed |= released - ids
            self._cv.notify_all()
            return released

    def let_through(self) -> set[int]:
        """Ids released or failing that have not passed the gate yet."""
        with self._cv:
            return self._allowed | self._failing

    def open(self) -> None:
        """Let everything through from now on (shutdown)."""
        with self._cv:
            self._open = True
            self._cv.notify_all()

    def _with_predecessors(self, job_ids: Iterable[int]) -> set[int]:
        out = set(job_ids)
        for job_id in list(out):
            kind = self._kind.get(job_id)
            if kind is None:
                continue
            lane = self._lanes[kind]
            out.update(lane[: lane.index(job_id)])
        return out

    def _forget(self, job_id: int) -> None:
        kind = self._kind.pop(job_id, None)
        if kind is not None:
            self._lanes[kind].remove(job_id)
        self._allowed.discard(job_id)
        self._failing.discard(job_id)


class GatedTiers(Generic[J]):
    """A worker's tier lane (or staged loads) whose jobs start only when released, or
    fail unstarted as a tier that failed as a whole (a tier load's: every tier chunk
    with ``error_failure``, as the real worker reports a tier that raised)."""

    def __init__(self, inner: JobLane[J]) -> None:
        self.inner: JobLane[J] = inner
        self.held: dict[int, J] = {}
        self._failed: list[JobResult] = []

    def submit(self, job: J) -> None:
        self.held[job.job_id] = job

    def release(self, job_ids: Iterable[int]) -> set[int]:
        ids = {i for i in job_ids if i in self.held}
        for job_id in sorted(ids):
            self.inner.submit(self.held.pop(job_id))
        return ids

    def fail(self, job_ids: Iterable[int], error: str = "injected tier failure") -> None:
        for job_id in sorted(set(job_ids)):
            job = self.held.pop(job_id, None)
            if job is None:
                continue
            failed: tuple[tuple[int, ChunkFailure], ...] = ()
            if isinstance(job, EngineJob):
                failed = tuple((c, error_failure(error)) for c in job.tier_chunks())
            self._failed.append(JobResult(job_id, False, error=error, failed_chunks=failed))

    def poll(self) -> list[JobResult]:
        failed, self._failed = self._failed, []
        return self.inner.poll() + failed

    def running(self) -> set[int]:
        return self.inner.running() | set(self.held)

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> bool:
        return self.inner.wait(set(job_ids) - set(self.held), timeout)

    def quarantined(self) -> set[int]:
        return self.inner.quarantined()

    def take_returned(self) -> list[int]:
        """The tier lane's timed-out jobs whose I/O returned (staged loads: none)."""
        take = getattr(self.inner, "take_returned", None)
        return list(take()) if take is not None else []

    def shutdown(self, timeout: float | None = 10.0) -> None:
        self.fail(list(self.held), "cancelled: worker shut down")
        self.inner.shutdown(timeout)


class TornWrites:
    """The disk tier's store, with the chunks ``torn(key)`` selects torn: written, then
    one payload byte of the slot damaged on disk while the write reports success (as
    when a crash or a bad disk loses part of a write). The reader's checksum finds it."""

    def __init__(self, inner: DiskTierStore, torn: Callable[[ChunkKey], bool]) -> None:
        self.inner = inner
        self.torn = torn
        self.count = 0

    def write_many(
        self,
        items: Sequence[tuple[ChunkKey, memoryview]],
        slots: Sequence[int],
        groups: Sequence[int] = (),
    ) -> list[ChunkFailure | None]:
        results = self.inner.write_many(items, slots, groups)
        store = self.inner.store
        for (key, payload), slot, failure in zip(items, slots, results, strict=True):
            if failure is None and self.torn(key):
                offset = store.offset(slot) + PAYLOAD_OFFSET + len(payload) // 2
                with open(store.path, "r+b") as f:
                    f.seek(offset)
                    byte = f.read(1)
                    f.seek(offset)
                    f.write(bytes([byte[0] ^ 0xFF]))
                self.count += 1
        return results

    def read_many(
        self,
        keys: Sequence[ChunkKey],
        slots: Sequence[int],
        outs: Sequence[memoryview],
        groups: Sequence[int] = (),
    ) -> list[ChunkFailure | None]:
        return self.inner.read_many(keys, slots, outs, groups)

    def close(self) -> None:
        self.inner.close()
