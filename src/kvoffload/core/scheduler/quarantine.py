"""The quarantine of tier jobs reported at their deadline while their I/O may still
run (decision 0011).

A worker reports a spill or promotion still running past ``tier_io_timeout_ms`` as
failed at once (every chunk ``FailureKind.TIMEOUT``), so the request that waited for
a promotion goes on; but its thread may still be inside the tier call, reading the
job's host slots (a spill: a late write of changed bytes would be a chunk with the
wrong KV under a valid checksum) or writing them (a promotion). Until every worker
that timed the job out says its I/O returned (:attr:`WorkerReport.released
<kvoffload.core.jobs.WorkerReport.released>`), the memory stays reserved exactly as
while the job was in flight: the job's completion in the tier planner (which drops a
spill's host pins and tier room, frees a promotion's reserved host slots) is *parked*
here and run at the last release. A parked promotion's chunks are discarded from the
host directory at once (they miss, instead of looking up as pending; their slots stay
STORING until the completion runs).

Ranks: each worker's TIMEOUT result names it pending (:meth:`Quarantine.note`); its
release, in the same report or a later one, clears it (:meth:`release`). The
completion, when every worker reported the job, is parked if some worker is still
pending (:meth:`park`), else runs at once. Unknown releases are ignored.

Owned by :class:`~kvoffload.core.scheduler.tier_moves.TierMoves`; mutates the host
directory (discards) and, through the parked completions, the tier planner. Never
raises on surprising reports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvoffload.core.directory import HostDirectory
from kvoffload.core.jobs import JobKind, JobResult, TierJob


@dataclass
class _Held:
    job: TierJob
    pending: set[int] = field(default_factory=set)  # ranks whose I/O has not returned
    parked: Callable[[], None] | None = None  # the completion, once every rank reported


class Quarantine:
    def __init__(self, host: HostDirectory) -> None:
        self.host = host
        self._held: dict[int, _Held] = {}

    def note(self, rank: int, job: TierJob, result: JobResult) -> None:
        """One worker's result of ``job``: a TIMEOUT makes that worker pending."""
        if any(f.timed_out for _, f in result.failed_chunks):
            self._held.setdefault(job.job_id, _Held(job)).pending.add(rank)

    def park(self, job: TierJob, complete: Callable[[], None]) -> bool:
        """``job`` completed: run ``complete`` now (False) or, while a worker's I/O
        of it may still run, at its last release (True; a promotion's chunks miss
        from now on)."""
        held = self._held.get(job.job_id)
        if held is None or not held.pending:
            self._held.pop(job.job_id, None)
            return False
        held.parked = complete
        if job.kind is JobKind.PROMOTE:
            self.host.discard(job.keys)
        return True

    def release(self, rank: int, job_ids: tuple[int, ...]) -> None:
        """Worker ``rank``'s I/O of ``job_ids`` returned; run the completions no
        worker holds any more."""
        for job_id in job_ids:
            held = self._held.get(job_id)
            if held is None:
                continue
            held.pending.discard(rank)
            if held.pending or held.parked is None:
                continue
            del self._held[job_id]
            held.parked()

    def jobs(self) -> list[TierJob]:
        """The jobs whose completion is parked (their memory is still reserved)."""
        return [h.job for h in self._held.values() if h.parked is not None]

    def chunks(self, tier: str) -> int:
        """Host chunks held by parked jobs of lower tier ``tier``."""
        return sum(len(job.keys) for job in self.jobs() if job.tier == tier)

    def __bool__(self) -> bool:
        return any(h.parked is not None for h in self._held.values())
