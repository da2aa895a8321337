"""Building each step's plan (a part of :class:`~kvoffload.core.scheduler.OffloadScheduler`).

Kept in its own module for size: the request lifecycle (lookup, allocation, the end
of requests, reports) lives in :mod:`kvoffload.core.scheduler`, the per-step plan
(stores, promotions, spills, flushes) here. Same object, same contracts.
"""

from __future__ import annotations

from collections.abc import Callable

from kvoffload.core.anomalies import Anomaly, AnomalyLog
from kvoffload.core.directory import Directory
from kvoffload.core.job_tracker import JobTracker
from kvoffload.core.jobs import JobKind, StepPlan, TransferJob
from kvoffload.core.metrics import MetricsRecorder
from kvoffload.core.request_state import Phase, RequestState
from kvoffload.core.scheduler_types import SchedulerConfig, SchedulerStats, StepInput
from kvoffload.core.store_planning import fenced_stores, plan_store_job
from kvoffload.core.tier_planning import TierPlanner


class StepPlanning:
    """The plan-building half of the scheduler half (a mixin; see the module doc)."""

    config: SchedulerConfig
    directory: Directory
    tiers: TierPlanner
    stats: SchedulerStats
    metrics: MetricsRecorder
    anomalies: AnomalyLog
    clock: Callable[[], float]
    _states: dict[str, RequestState]
    _tracker: JobTracker
    _step: int
    _busy_steps: int
    _pending_loads: list[TransferJob]
    _pending_flush: set[int]
    _fresh_blocks: set[int]
    _finishing: list[str]
    _promotions: list[str]

    def _end_deferral(self, state: RequestState) -> None:
        """The request is admitted: record how long it was deferred, if it was."""
        if state.deferred_since_s is not None and state.deferral_reason is not None:
            waited = self.clock() - state.deferred_since_s
            self.metrics.observe_deferral(state.deferral_reason.value, waited)
        state.clear_deferral()

    def _track(self, state: RequestState, job: TransferJob) -> None:
        self._tracker.add(job)
        state.jobs[job.job_id] = job

    def on_preempted(self, request_id: str) -> None:
        """The engine freed a running request's blocks and re-queued it: its stores
        are flushed in the next plan, and it is deferred until its jobs are reported.
        Idempotent; ignored for requests that are not running."""
        state = self._states.get(request_id)
        if state is None or state.phase is not Phase.RUNNING:
            return
        state.block_ids.clear()
        self._pending_flush.update(state.store_ids())
        self.stats.preemptions += 1
        # Stores, or a promotion still running from before its admission: it is
        # looked up again only once they drained.
        state.move(Phase.PREEMPTED_DRAINING if state.jobs else Phase.WAITING)

    def _drop(self, state: RequestState) -> None:
        state.move(Phase.DONE)
        del self._states[state.request_id]

    # -------------------------------------------------------------------- plan

    def build_plan(self, step: StepInput) -> StepPlan:
        """The plan for this engine step (see :class:`StepPlan`); resets the
        per-step bookkeeping."""
        self._step += 1
        if step.scheduled:
            self._busy_steps += 1
        for request_id in step.preempted:
            self.on_preempted(request_id)
        # Spills first: they pin chunks whose host store just completed, so this
        # step's new stores cannot evict them before they are written down.
        spills = self.tiers.plan_spills(self._tracker.new_id) if self.tiers else []
        for job in spills:
            self._tracker.add(job)
        stores: list[TransferJob] = []
        for sched in step.scheduled:
            state = self._states.get(sched.request_id)
            if state is None or state.phase not in (
                Phase.WAITING,
                Phase.RUNNING,
                Phase.PREEMPTED_DRAINING,
            ):
                phase = "unknown" if state is None else state.phase.name
                self.anomalies.note(
                    Anomaly.UNTRACKED_REQUEST,
                    f"request {sched.request_id!r} scheduled while {phase} here; not offloaded",
                )
                continue
            if sched.replace:
                state.block_ids = list(sched.block_ids)
                held = sched.num_computed_tokens // self.config.block_size
                self._fresh_blocks.update(sched.block_ids[held:])
            else:
                state.block_ids.extend(sched.block_ids)
                self._fresh_blocks.update(sched.block_ids)
            state.computed_tokens = sched.num_computed_tokens + sched.num_scheduled_tokens
            self._end_deferral(state)
            state.move(Phase.RUNNING)
            self._plan_stores(state, stores)
        for request_id in self._finishing:
            state = self._states.get(request_id)
            if state is not None and state.final_store_pending:
                state.final_store_pending = False
                self._plan_stores(state, stores)
                if not state.jobs:
                    self._drop(state)
        promotions = self._plan_promotions()
        flush = self._pending_flush | fenced_stores(self._tracker, self._states, self._fresh_blocks)
        if flush:
            flush &= {job.job_id for job in self._tracker.jobs() if job.kind is JobKind.STORE}
        plan = StepPlan(
            self._step,
            tuple(self._pending_loads),
            tuple(stores),
            frozenset(flush),
            spills=tuple(spills),
            promotions=tuple(promotions),
        )
        self.stats.flushes += len(flush)
        self._pending_loads = []
        self._pending_flush = set()
        self._fresh_blocks = set()
        self._finishing = []
        return plan

    def _plan_promotions(self) -> list[TransferJob]:
        jobs = []
        for request_id in self._promotions:
            state = self._states.get(request_id)
            if state is None or state.promotion is None:
                continue
            tier, keys = state.promotion
            state.promotion = None
            if state.phase is not Phase.WAITING or state.jobs:
                continue
            job = self.tiers.plan_promotion(request_id, tier, keys, self._tracker.new_id)
            if job is None:
                state.no_promotion = True
                continue
            self._track(state, job)
            state.move(Phase.PROMOTING)
            jobs.append(job)
        self._promotions = []
        return jobs

    def _plan_stores(self, state: RequestState, out: list[TransferJob]) -> None:
        job = plan_store_job(
            state, self.directory, self._tracker.new_id, self.config, self.anomalies
        )
        if job is None:
            return
        self._track(state, job)
        out.append(job)
        self.stats.stores += 1
        self.stats.stored_chunks += len(job.keys)
