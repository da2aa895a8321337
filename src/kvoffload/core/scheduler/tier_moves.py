"""The tier-move family: spills (host memory to a lower tier) and promotions (a
lower tier to host memory), planned each step and completed here.

Spills are the tier planner's (they follow host stores, not requests). A promotion
is wished by a lookup (``state.promotion``) and planned in the next plan when the
request still waits with nothing in flight; when it cannot be planned (no room, the
run changed) the request takes what host memory has (``no_promotion``). Mutates
the tier planner, the wishing requests' phase and promotion fields.

A spill or promotion a worker timed out completes for its request at once, but its
completion in the tier planner waits in the :class:`Quarantine` until the I/O
returned on every worker that timed it out (``quarantine.py``).
"""

from __future__ import annotations

from kvoffload.core.jobs import JobResult, TierJob
from kvoffload.core.scheduler.context import Context
from kvoffload.core.scheduler.quarantine import Quarantine
from kvoffload.core.scheduler.request_state import Phase


class TierMoves:
    def __init__(self, ctx: Context) -> None:
        self.tiers = ctx.tiers
        self.requests = ctx.requests
        self.cost = ctx.cost
        self.metrics = ctx.metrics
        self._lower = bool(ctx.tiers)  # lower tiers are fixed at construction
        self.quarantine = Quarantine(ctx.directory)

    def plan_spills(self) -> list[TierJob]:
        """This step's spills, tracked (they belong to no request)."""
        if not self._lower:
            return []
        tracker = self.requests.tracker
        spills = self.tiers.plan_spills(tracker.new_id)
        for job in spills:
            tracker.add(job)
        return spills

    def plan_promotions(self, wished: list[str]) -> list[TierJob]:
        jobs: list[TierJob] = []
        if not wished:
            return jobs
        for request_id in wished:
            state = self.requests.get(request_id)
            if state is None or state.promotion is None:
                continue
            wish, state.promotion = state.promotion, None
            if state.phase is not Phase.WAITING or self.requests.tracker.has_jobs(request_id):
                continue
            job = self.tiers.plan_promotion(
                request_id, wish.tier, wish.keys, self.requests.tracker.new_id, wish.groups
            )
            if job is None:
                state.no_promotion = True
                continue
            if self.cost.planned(job):  # a declined lane's probe, by promotion
                self.metrics.count("cost_probes_total", tier=job.tier)
            self.requests.tracker.add(job)
            state.move(Phase.PROMOTING)
            jobs.append(job)
        return jobs

    def note(self, rank: int, job: TierJob, result: JobResult) -> None:
        """One worker's result of a spill or promotion (before it is counted)."""
        self.quarantine.note(rank, job, result)

    def released(self, rank: int, job_ids: tuple[int, ...]) -> None:
        """Worker ``rank``'s timed-out I/O of ``job_ids`` returned."""
        if job_ids:
            self.quarantine.release(rank, job_ids)

    def complete(self, job: TierJob, result: JobResult) -> None:
        """A spill or promotion every worker reported: book it in the tiers, now or,
        while a timed-out I/O of it may still run, when it returned."""
        self.tiers.count_timeouts(job.tier, job.kind.value, result)
        if not self.quarantine.park(job, lambda: self.tiers.complete(job, result)):
            self.tiers.complete(job, result)
