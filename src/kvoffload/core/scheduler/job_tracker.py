"""Jobs in flight: ids, per-worker completion counting, block fences, and what each
request has in flight.

The tracker is the one owner of the jobs in flight: a job is in it from
:meth:`JobTracker.add` (when it is planned) until it completes. A job completes
exactly once: when every one of ``world_size`` workers has reported it (a repeated
report from the same worker, or a report of an unknown or already completed job, is
ignored and counted by the caller). It succeeded only if every worker succeeded.

Two indexes follow the jobs, kept by :meth:`add` and :meth:`record` alone. The fence
index maps each engine block read by an in-flight store job to that job, so the
scheduler half can flush a store before its source block is handed out for
overwrite (a block a job names twice is fenced once). The request index maps a
request id to its jobs in flight, in the order they were added: what a request has
in flight (:meth:`jobs_of`, :meth:`has_jobs`, :meth:`has_load`,
:meth:`has_promotion`, :meth:`store_ids`) is read from it. A job serving no request
(a spill, ``request_id`` None) is in no request's index. Nothing here raises on a
surprising result. Owned by one scheduler half; a connector reset leaves it alone
(jobs in flight still complete).
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
        self._by_request: dict[str, dict[int, None]] = {}  # request id -> job ids, in order

    def new_id(self) -> int:
        """A job id never handed out before (monotonic, also across resets)."""
        self._next_id += 1
        return self._next_id

    def job(self, job_id: int) -> TransferJob | None:
        """The in-flight job with this id, if any."""
        tracked = self._jobs.get(job_id)
        return None if tracked is None else tracked.job

    def add(self, job: TransferJob) -> None:
        """Track a planned job (in flight until every worker reported it)."""
        self._jobs[job.job_id] = _Tracked(job)
        if job.request_id is not None:
            self._by_request.setdefault(job.request_id, {})[job.job_id] = None
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
        self._unindex(job)
        merged = JobResult(
            job.job_id,
            tracked.success,
            tracked.nbytes,
            tracked.seconds,
            tracked.error,
            tuple(sorted(tracked.failed_chunks.items())),
        )
        return Completion(job, merged)

    def _unindex(self, job: TransferJob) -> None:
        """Drop a completed job from the request index and the fence index."""
        if job.request_id is not None:
            mine = self._by_request[job.request_id]
            del mine[job.job_id]
            if not mine:
                del self._by_request[job.request_id]
        if not (isinstance(job, EngineJob) and job.kind is JobKind.STORE):
            return
        for block in set(job.block_ids):
            waiting = self._fences.get(block)
            if waiting is None:
                continue
            waiting.discard(job.job_id)
            if not waiting:
                del self._fences[block]

    def fenced(self, blocks: Iterable[int]) -> set[int]:
        """Ids of in-flight store jobs that read any of ``blocks``."""
        out: set[int] = set()
        fences = self._fences
        for block in blocks:
            jobs = fences.get(block)
            if jobs:
                out |= jobs
        return out

    def has_fences(self) -> bool:
        """Whether any store in flight reads an engine block."""
        return bool(self._fences)

    def counts(self, rank: int, job_id: int) -> bool:
        """Whether a result of ``rank`` for ``job_id`` would be counted by
        :meth:`record` now (a job in flight, a rank in range that has not reported it)."""
        tracked = self._jobs.get(job_id)
        return tracked is not None and 0 <= rank < self.world_size and rank not in tracked.reported

    def get(self, job_id: int) -> TransferJob | None:
        tracked = self._jobs.get(job_id)
        return None if tracked is None else tracked.job

    def __len__(self) -> int:
        return len(self._jobs)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._jobs

    def jobs(self) -> list[TransferJob]:
        return [t.job for t in self._jobs.values()]

    # ------------------------------------------------------------ per request

    def jobs_of(self, request_id: str) -> tuple[TransferJob, ...]:
        """The request's jobs in flight, in the order they were added."""
        return tuple(self._jobs[i].job for i in self._by_request.get(request_id, ()))

    def has_jobs(self, request_id: str) -> bool:
        """Whether any job of the request is in flight."""
        return request_id in self._by_request

    def has_load(self, request_id: str) -> bool:
        return self._has(request_id, JobKind.LOAD)

    def has_promotion(self, request_id: str) -> bool:
        return self._has(request_id, JobKind.PROMOTE)

    def _has(self, request_id: str, kind: JobKind) -> bool:
        ids = self._by_request.get(request_id)  # called for every request, every step
        return ids is not None and any(self._jobs[i].job.kind is kind for i in ids)

    def store_ids(self, request_id: str) -> list[int]:
        """Ids of the request's store jobs in flight, in the order they were added."""
        return [job.job_id for job in self.jobs_of(request_id) if job.kind is JobKind.STORE]

    def fence_count(self) -> int:
        """Fence entries: (block, store job) pairs, each block counted once per job."""
        return sum(len(j) for j in self._fences.values())
