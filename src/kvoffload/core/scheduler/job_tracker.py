"""Jobs in flight: ids, per-worker completion counting, and block fences.

A job completes exactly once: when every one of ``world_size`` workers has reported
it (a repeated report from the same worker, or a report of an unknown or already
completed job, is ignored and counted by the caller). It succeeded only if every
worker succeeded. The fence index maps each engine block read by an in-flight store
job to that job, so the scheduler half can flush a store before its source block is
handed out for overwrite (a block a job names twice is fenced once). Nothing
here raises on a surprising result. Owned by one scheduler half.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvoffload.core.failures import ChunkFailure
from kvoffload.core.jobs import EngineJob, JobKind, JobResult, TransferJob


@dataclass
class _Tracked:
    job: TransferJob
    reported: set[int] = field(default_factory=set)
    success: bool = True
    failed_chunks: dict[int, ChunkFailure] = field(default_factory=dict)
    nbytes: int = 0
    seconds: float = 0.0
    error: str | ChunkFailure = ""


@dataclass(frozen=True)
class Completion:
    """A job every worker has now reported; ``result`` merges their results (failed
    if any failed; the union of the chunks any worker failed)."""

    job: TransferJob
    result: JobResult

    @property
    def success(self) -> bool:
        return self.result.success


class JobTracker:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self._next_id = 0
        self._jobs: dict[int, _Tracked] = {}
        self._fences: dict[int, set[int]] = {}

    def new_id(self) -> int:
        """A job id never handed out before (monotonic, also across resets)."""
        self._next_id += 1
        return self._next_id

    def job(self, job_id: int) -> TransferJob | None:
        """The in-flight job with this id, if any."""
        tracked = self._jobs.get(job_id)
        return None if tracked is None else tracked.job

    def add(self, job: TransferJob) -> None:
        self._jobs[job.job_id] = _Tracked(job)
        if isinstance(job, EngineJob) and job.kind is JobKind.STORE:
            for block in set(job.block_ids):
                self._fences.setdefault(block, set()).add(job.job_id)

    def record(self, rank: int, result: JobResult) -> Completion | None:
        """Count ``rank``'s result; return the completion once all workers reported.

        Returns None for unknown jobs, repeated reports and ranks out of range."""
        tracked = self._jobs.get(result.job_id)
        if tracked is None or rank in tracked.reported or not 0 <= rank < self.world_size:
            return None
        tracked.reported.add(rank)
        tracked.success = tracked.success and result.success
        tracked.error = tracked.error or result.error
        tracked.nbytes += result.nbytes
        tracked.seconds = max(tracked.seconds, result.seconds)
        for index, failure in result.failed_chunks:
            tracked.failed_chunks.setdefault(index, failure)
        if len(tracked.reported) < self.world_size:
            return None
        del self._jobs[result.job_id]
        job = tracked.job
        if isinstance(job, EngineJob) and job.kind is JobKind.STORE:
            for block in set(job.block_ids):
                waiting = self._fences.get(block)
                if waiting is None:
                    continue
                waiting.discard(job.job_id)
                if not waiting:
                    del self._fences[block]
        merged = JobResult(
            job.job_id,
            tracked.success,
            tracked.nbytes,
            tracked.seconds,
            tracked.error,
            tuple(sorted(tracked.failed_chunks.items())),
        )
        return Completion(job, merged)

    def fenced(self, blocks: Iterable[int]) -> set[int]:
        """Ids of in-flight store jobs that read any of ``blocks``."""
        out: set[int] = set()
        fences = self._fences
        for block in blocks:
            jobs = fences.get(block)
            if jobs:
                out |= jobs
        return out

    def get(self, job_id: int) -> TransferJob | None:
        tracked = self._jobs.get(job_id)
        return None if tracked is None else tracked.job

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def jobs(self) -> list[TransferJob]:
        return [t.job for t in self._jobs.values()]

    def fence_count(self) -> int:
        """Fence entries: (block, store job) pairs, each block counted once per job."""
        return sum(len(j) for j in self._fences.values())
