"""When the harness's transfers finish: the policy interface and the default one."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvoffload.core.jobs import JobResult, TransferJob


class Completions(Protocol):
    """Per rank and step: which open jobs to release and which to fail, in which
    order the ranks run and how each rank's report is ordered. ``copies`` decides
    the engine copies (loads, stores, and a tier load's host half: an EngineJob of
    its host chunks, same id); ``tier_jobs`` the spills, promotions and a tier
    load's tier half (the tier load itself, ``job.tier`` set): a failed one fails as
    a tier that failed as a whole."""

    def copies(
        self, rank: int, step: int, jobs: Sequence[TransferJob]
    ) -> tuple[set[int], set[int]]: ...

    def tier_jobs(
        self, rank: int, step: int, jobs: Sequence[TransferJob]
    ) -> tuple[set[int], set[int]]: ...

    def rank_order(self, step: int, world_size: int) -> list[int]: ...

    def order(self, rank: int, step: int, results: list[JobResult]) -> list[JobResult]: ...


@dataclass
class CompleteAll:
    """Every job finishes in the step it was submitted (``release=False``: none does
    until a later policy says so); ``fail``: these job ids fail."""

    release: bool = True
    fail: set[int] = field(default_factory=set)

    def copies(
        self, rank: int, step: int, jobs: Sequence[TransferJob]
    ) -> tuple[set[int], set[int]]:
        ids = {j.job_id for j in jobs}
        return (ids - self.fail if self.release else set()), ids & self.fail

    tier_jobs = copies

    def rank_order(self, step: int, world_size: int) -> list[int]:
        return list(range(world_size))

    def order(self, rank: int, step: int, results: list[JobResult]) -> list[JobResult]:
        return results
