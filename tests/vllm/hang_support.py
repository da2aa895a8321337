"""A completion policy of the harness that hangs tier reads inside the worker, past
their deadline (``IoHangs``): the tier-deadline and cost-model tests share it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvoffload.core.jobs import JobKind, TransferJob
from kvoffload.testing.vllm_harness import CompleteAll, VllmHarness


@dataclass
class HangReads(CompleteAll):
    """Every job completes at once, except that the first tier read of each job of
    ``kinds`` (a tier load's tier half, a promotion) hangs inside the worker; ``left``
    bounds how many more reads hang (None: every one)."""

    harness: VllmHarness | None = None
    kinds: tuple[JobKind, ...] = (JobKind.LOAD,)
    left: int | None = None
    hung: list[int] = field(default_factory=list)

    def tier_jobs(
        self, rank: int, step: int, jobs: Sequence[TransferJob]
    ) -> tuple[set[int], set[int]]:
        assert self.harness is not None
        for job in jobs:
            reads = job.kind in self.kinds and (job.kind is not JobKind.LOAD or job.tier)
            if reads and job.job_id not in self.hung and self.left != 0:
                self.harness.hangs.arm(rank, job.job_id)
                self.hung.append(job.job_id)
                if self.left is not None:
                    self.left -= 1
        return {j.job_id for j in jobs}, set()
