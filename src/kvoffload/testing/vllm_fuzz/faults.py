"""A scenario's faults as a completion policy for the harness.

Every decision is a pure function of the scenario's seed, the job, the rank and the
step (a keyed hash, no shared random stream), so removing a request or a fault while
shrinking leaves the other decisions as they were. A job is *open* on a rank from the
step it was submitted there; the policy releases it after its delay (0: the same
step), fails it, or (``HANG_TIER``) holds it until the run drains.

Tier faults hit spills, promotions and tier loads' tier halves alike (a failing or
slow disk, Redis going away), except that a tier load never hangs: the request waits
for it holding its engine blocks, with no deferral bound to end the wait, while a
real tier read ends within the tier's timeout (a hung one is slow, then).
"""

from __future__ import annotations

import hashlib
import random
from collections import Counter
from collections.abc import Sequence

from kvoffload.core.jobs import EngineJob, JobKind, JobResult, TransferJob
from kvoffload.testing.vllm_fuzz.scenario import FaultKind, Scenario

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
        return release, fail

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
