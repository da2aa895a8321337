"""A scenario's faults as a completion policy for the harness.

Every decision is a pure function of the scenario's seed, the job, the rank and the
step (a keyed hash, no shared random stream), so removing a request or a fault while
shrinking leaves the other decisions as they were. A job is *open* on a rank from the
step it was submitted there; the policy releases it after its delay (0: the same
step), fails it, or (``HANG_TIER``) holds it until the run drains.

Tier faults hit spills, promotions and tier loads' tier halves alike (a failing or
slow disk, Redis going away), except that a tier load never hangs in the gate
(``HANG_TIER`` holds a job before the worker has it, so no deadline runs: the request
would wait holding its engine blocks). ``HUNG_IO`` hangs a job's tier call *inside*
the worker (:class:`~kvoffload.testing.vllm_harness.hangs.IoHangs`), any job's, tier
loads' too: the job's deadline fires, the request goes on (recompute), and the call
returns ``steps`` later or, for the ``never`` share, once the requests are done;
its late bytes must land nowhere the engine or another job uses.
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Sequence

from kvoffload.core.jobs import EngineJob, JobKind, JobResult, TransferJob
from kvoffload.testing.vllm_fuzz.scenario import FaultKind, Scenario
from kvoffload.testing.vllm_harness.hangs import IoHangs

READ_HANG_RATE = 0.6
"""``HUNG_IO``'s least rate for reads (tier loads, promotions): rarer than spills."""

_FAIL = {JobKind.STORE: FaultKind.FAIL_STORE, JobKind.LOAD: FaultKind.FAIL_LOAD}
_SLOW = {JobKind.STORE: FaultKind.SLOW_STORE, JobKind.LOAD: FaultKind.SLOW_LOAD}


def chance(seed: int, *parts: object) -> float:
    """A number in [0, 1) fixed by ``seed`` and ``parts``."""
    digest = hashlib.blake2b(repr((seed, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


class FaultPolicy:
    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.draining = False  # the requests are done: everything held is let go
        self.injected: Counter[str] = Counter()
        self._opened: dict[tuple[int, int], int] = {}
        self._seen: set[tuple[str, int, int]] = set()
        self.hangs: IoHangs | None = None  # the harness's, for HUNG_IO
        self._hung: dict[tuple[int, int], int | None] = {}  # (rank, job): return step

    def _hits(self, kind: FaultKind, *parts: object) -> bool:
        fault = self.scenario.fault(kind)
        return fault is not None and chance(self.scenario.seed, kind.value, *parts) < fault.rate

    def _steps(self, kind: FaultKind, *parts: object) -> int:
        fault = self.scenario.fault(kind)
        if fault is None or not self._hits(kind, *parts):
            return 0
        return 1 + int(chance(self.scenario.seed, kind.value, "steps", *parts) * fault.steps)

    def _delay(self, slow: FaultKind, job: TransferJob, rank: int) -> int:
        delay = self._steps(slow, job.job_id)
        if rank > 0:
            delay += self._steps(FaultKind.RANK_SKEW, job.job_id, rank)
        return delay

    def copies(
        self, rank: int, step: int, jobs: Sequence[TransferJob]
    ) -> tuple[set[int], set[int]]:
        release: set[int] = set()
        fail: set[int] = set()
        for job in jobs:
            opened = self._opened.setdefault((rank, job.job_id), step)
            if not self.draining and self._hits(_FAIL[job.kind], job.job_id, rank):
                fail.add(job.job_id)
                self._count(f"failed_{job.kind.value}", rank, job)
            elif self.draining or step >= opened + self._delay(_SLOW[job.kind], job, rank):
                release.add(job.job_id)
        return release, fail

    def tier_jobs(
        self, rank: int, step: int, jobs: Sequence[TransferJob]
    ) -> tuple[set[int], set[int]]:
        release: set[int] = set()
        fail: set[int] = set()
        self._return_hung(rank, step)
        for job in jobs:
            opened = self._opened.setdefault((rank, job.job_id), step)
            what = "tier_load" if isinstance(job, EngineJob) else job.kind.value
            if self.draining:
                release.add(job.job_id)
            elif self._hits(FaultKind.FAIL_TIER, job.job_id, rank):
                fail.add(job.job_id)
                self._count(f"failed_{what}", rank, job)
            elif what != "tier_load" and self._hits(FaultKind.HANG_TIER, job.job_id):
                self._count(f"hung_{what}", rank, job)
            elif step >= opened + self._delay(FaultKind.SLOW_TIER, job, rank):
                release.add(job.job_id)
                self._hang(rank, step, job, what)
        return release, fail

    def _hang(self, rank: int, step: int, job: TransferJob, what: str) -> None:
        """Maybe hang the job's first tier call on ``rank`` (it is released now)."""
        fault = self.scenario.fault(FaultKind.HUNG_IO)
        if fault is None or self.hangs is None:
            return
        seed, kind = self.scenario.seed, fault.kind.value
        rate = fault.rate if what == "spill" else max(fault.rate, READ_HANG_RATE)
        if chance(seed, kind, job.job_id, rank) >= rate:
            return
        never = chance(seed, kind, "never", job.job_id, rank) < fault.never
        steps = 1 + int(chance(seed, kind, "steps", job.job_id, rank) * fault.steps)
        self._hung[(rank, job.job_id)] = None if never else step + steps
        self.hangs.arm(rank, job.job_id)
        self._count(f"hung_io_{what}", rank, job)

    def _return_hung(self, rank: int, step: int) -> None:
        """Let the hung calls on ``rank`` whose time came return (all, draining)."""
        if self.hangs is None or not self._hung:
            return
        due = [
            job_id
            for (r, job_id), until in self._hung.items()
            if r == rank and (self.draining or (until is not None and step >= until))
        ]
        for job_id in due:
            del self._hung[(rank, job_id)]
        self.hangs.release(rank, due)

    def rank_order(self, step: int, world_size: int) -> list[int]:
        ranks = list(range(world_size))
        if self._hits(FaultKind.REORDER, "ranks", step):
            ranks.reverse()
        return ranks

    def order(self, rank: int, step: int, results: list[JobResult]) -> list[JobResult]:
        if len(results) > 1 and self._hits(FaultKind.REORDER, "results", rank, step):
            results = list(results)
            random.Random(f"{self.scenario.seed}:{rank}:{step}").shuffle(results)
            self.injected["reordered_reports"] += 1
        return results

    def _count(self, what: str, rank: int, job: TransferJob) -> None:
        key = (what, rank, job.job_id)
        if key not in self._seen:
            self._seen.add(key)
            self.injected[what] += 1
