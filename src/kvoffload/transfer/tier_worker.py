"""The worker's tier lane: spill and promote jobs between host slots and lower tiers.

One per model worker, next to the :class:`~kvoffload.transfer.worker.TransferWorker`
(which moves engine blocks <-> host slots). A spill job writes its host slots to a
tier under its keys (after deleting ``drop_keys``); a promote job reads chunks from
a tier, verified, into its host slots. Each job runs on a small thread pool (tier I/O
blocks: disks, networks), so a slow tier delays only its own jobs.

Results follow :class:`~kvoffload.core.jobs.JobResult`: a chunk that failed inside
a job is listed in ``failed_chunks`` with its reason; a job that failed as a whole
(the tier raised: connection refused, timeout) has ``success=False``. Nothing here
raises into the engine. The scheduler half pins spilled slots and reserves promoted
ones, so no other job touches them meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from kvoffload.core.jobs import JobKind, JobResult, TransferJob
from kvoffload.core.keys import ChunkKey
from kvoffload.tiers.host import HostSlab
from kvoffload.transfer.results import ResultBook


class TierStore(Protocol):
    """One rank's share of a lower tier, as the tier lane uses it."""

    def write_many(self, items: Sequence[tuple[ChunkKey, memoryview]]) -> list[str | None]: ...

    def read_many(
        self, keys: Sequence[ChunkKey], outs: Sequence[memoryview]
    ) -> list[str | None]: ...

    def delete_many(self, keys: Sequence[ChunkKey]) -> None: ...


class TierWorker:
    def __init__(self, slab: HostSlab, stores: dict[str, TierStore], *, threads: int = 4):
        self.slab = slab
        self.stores = stores
        self._book = ResultBook()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvoffload-tier")
        self._closed = False

    def submit(self, job: TransferJob) -> None:
        """Start a spill or promote job (a bad job becomes a failed result)."""
        self._book.begin(job.job_id)
        if self._closed or job.tier not in self.stores or job.kind.touches_engine:
            self._book.fail(job.job_id, f"cannot run {job.kind.value} job on tier {job.tier!r}")
            return
        try:
            self._pool.submit(self._run, job)
        except RuntimeError as exc:
            self._book.fail(job.job_id, f"worker is shut down: {exc}")

    def poll(self) -> list[JobResult]:
        return self._book.take()

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

    def _run(self, job: TransferJob) -> None:
        store = self.stores[job.tier]
        begin = time.perf_counter()
        try:
            views = [self.slab.slot_bytes(slot) for slot in job.slots]
            if job.kind is JobKind.SPILL:
                if job.drop_keys:
                    store.delete_many(job.drop_keys)
                failures = store.write_many(list(zip(job.keys, views, strict=True)))
            else:
                failures = store.read_many(job.keys, views)
        except Exception as exc:
            self._book.fail(job.job_id, f"{type(exc).__name__}: {exc}")
            return
        failed = tuple((i, reason) for i, reason in enumerate(failures) if reason is not None)
        done = len(job.keys) - len(failed)
        self._book.finish(
            JobResult(
                job.job_id,
                success=done > 0 or not job.keys,
                nbytes=done * self.slab.chunk_bytes,
                seconds=time.perf_counter() - begin,
                error=failed[0][1] if failed and not done else "",
                failed_chunks=failed if done else (),
            )
        )
