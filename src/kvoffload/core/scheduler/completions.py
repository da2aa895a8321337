"""Worker reports into completions: each job completes once (every worker reported),
in the planner of its family, then on the request that waited for it.

Unknown and repeated results are ignored and counted (``stale_completions``). A
report's ``released`` ids (timed-out tier I/O that returned) go to the tier moves'
quarantine after its results.
Mutates the planners' state (directories, tiers), the job tracker (the completed job
leaves it), the requests' phases, the transfer histograms, the cost model's lanes.
"""

from __future__ import annotations

from kvoffload.core.identity.weights import FENCED
from kvoffload.core.jobs import ASLEEP, JobKind, TierJob, WorkerReport
from kvoffload.core.observe.recorder import MetricsRecorder
from kvoffload.core.scheduler.context import Context
from kvoffload.core.scheduler.job_tracker import Completion
from kvoffload.core.scheduler.loads import LoadPlanner
from kvoffload.core.scheduler.request_state import Phase, RequestState
from kvoffload.core.scheduler.stores import StorePlanner
from kvoffload.core.scheduler.tier_moves import TierMoves
from kvoffload.core.tiering.routes import tier_label


class Completions:
    def __init__(
        self,
        ctx: Context,
        metrics: MetricsRecorder,
        planners: tuple[LoadPlanner, StorePlanner, TierMoves],
    ) -> None:
        self.requests = ctx.requests
        self.stats = ctx.stats
        self.metrics = metrics
        self.cost = ctx.cost
        self.loads, self.stores, self.moves = planners

    def apply(self, report: WorkerReport) -> list[Completion]:
        """Apply one worker's results; the jobs that completed with them."""
        done: list[Completion] = []
        if not report.results:
            self.moves.released(report.rank, report.released)
            return done  # most steps: nothing finished
        tracker = self.requests.tracker
        for result in report.results:
            job = tracker.job(result.job_id)
            if job is not None:
                tier = tier_label(job)  # the lower tier a leg reads or writes, else host
                self.metrics.observe_transfer(job.kind.value, tier, result.nbytes, result.seconds)
                self.cost.observe(job, result)
                if isinstance(job, TierJob) and tracker.counts(report.rank, job.job_id):
                    self.moves.note(report.rank, job, result)
            completion = tracker.record(report.rank, result)
            if completion is None:
                if result.job_id not in tracker:
                    self.stats.stale_completions += 1
                continue
            self._complete(completion)
            done.append(completion)
        self.moves.released(report.rank, report.released)  # after the results they follow
        return done

    def _complete(self, completion: Completion) -> None:
        job = completion.job
        if not completion.success and completion.result.error == FENCED:
            self.metrics.count("fenced_jobs_total", direction=job.kind.value)
        if not completion.success and completion.result.error == ASLEEP:
            self.metrics.count("sleep_refused_jobs_total", direction=job.kind.value)
        if isinstance(job, TierJob):
            self.moves.complete(job, completion.result)
        elif job.kind is JobKind.STORE:
            self.stores.complete(completion)
        else:
            self.loads.complete(completion)
        state = None if job.request_id is None else self.requests.get(job.request_id)
        if state is not None:
            self._release(state, completion)

    def _release(self, state: RequestState, completion: Completion) -> None:
        """The request side of a completed job: the phase it waited in moves on."""
        job = completion.job  # already gone from the tracker
        if job.kind is JobKind.LOAD:
            state.load_failed |= not completion.success
            if state.phase is Phase.LOADING:
                state.move(Phase.RUNNING)
        if job.kind is JobKind.PROMOTE:
            if not completion.success or completion.result.failed_chunks:
                state.no_promotion = True  # take what arrived; no retry loop on a bad tier
            if state.phase is Phase.PROMOTING:
                state.move(Phase.WAITING)
        if self.requests.tracker.has_jobs(state.request_id):
            return
        if state.phase is Phase.PREEMPTED_DRAINING:
            state.move(Phase.WAITING)
        elif state.phase is Phase.FINISHED_DRAINING:
            self.requests.drop(state)  # FINISHING waits for its final store's plan
