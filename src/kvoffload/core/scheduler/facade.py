"""The scheduler half's façade: :class:`OffloadScheduler`, the engine's one entry point
(the call sequence and guarantees are in :mod:`kvoffload.core.scheduler`)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

from kvoffload.core.cost import CostModel
from kvoffload.core.directory import HostDirectory
from kvoffload.core.identity.weights import WeightsChange, WeightsState
from kvoffload.core.jobs import EngineJob, StepPlan, TransferJob, WorkerReport
from kvoffload.core.keys import Namespace
from kvoffload.core.observe.anomalies import Anomaly, AnomalyLog, ParamErrorLog
from kvoffload.core.observe.events import CacheEvent
from kvoffload.core.observe.recorder import MetricsRecorder
from kvoffload.core.scheduler.allocations import Allocations
from kvoffload.core.scheduler.block_tables import GroupBlocks
from kvoffload.core.scheduler.checks import verify_scheduler
from kvoffload.core.scheduler.completions import Completions
from kvoffload.core.scheduler.context import Context
from kvoffload.core.scheduler.deferral import DeferralClock
from kvoffload.core.scheduler.job_tracker import Completion, JobTracker
from kvoffload.core.scheduler.load_jobs import load_sources
from kvoffload.core.scheduler.loads import LoadPlanner
from kvoffload.core.scheduler.request_state import Phase, RequestState
from kvoffload.core.scheduler.requests import RequestTable
from kvoffload.core.scheduler.step_builder import StepBuilder
from kvoffload.core.scheduler.stores import StorePlanner
from kvoffload.core.scheduler.tier_moves import TierMoves
from kvoffload.core.scheduler_types import (
    SCHEDULER_SERIES,
    EngineRequest,
    SchedulerConfig,
    SchedulerStats,
    StepInput,
)
from kvoffload.core.tiering.lower import LowerTier
from kvoffload.core.tiering.planning import TierPlanner


class OffloadScheduler:
    """The engine-agnostic scheduler half of kvoffload (see the module docstring).

    A façade: the request table owns the request states, the job tracker the jobs in
    flight, the deferral clock busy steps and time, the step builder what
    accumulates between two plans; one planner per job family (loads, stores, tier
    moves) owns both the planning and the completion of its jobs."""

    def __init__(
        self,
        config: SchedulerConfig,
        directory: HostDirectory,
        namespace: Namespace,
        *,
        lower_tiers: Sequence[LowerTier] = (),
        spill_after_hits: int = 0,
        clock: Callable[[], float] = time.monotonic,
        new_epoch: Callable[[], bytes] = lambda: os.urandom(16),
        weights: WeightsState | None = None,
    ) -> None:
        """``weights``: what is known of the engine's weights (decision 0019): a
        state its workers report fingerprints into (the vLLM connector), or None: a
        fixed one (the reference engine and the simulator, whose workers report none)."""
        self.config = config
        self.directory = directory
        self.namespace = namespace
        self.tiers = TierPlanner(
            directory,
            lower_tiers,
            chunk_tokens=config.chunk_tokens,
            spill_after_hits=spill_after_hits,
            grouped=not config.kv_groups.single,
        )
        self.stats = SchedulerStats()
        self.metrics = MetricsRecorder()  # every counter and histogram of this half
        self.metrics.declare_all(SCHEDULER_SERIES)
        directory.metrics.rebind(self.metrics)  # the directory and tiers count into it too
        for tier in lower_tiers:
            tier.metrics.rebind(self.metrics)
        self.anomalies = AnomalyLog(self.metrics)
        self._new_epoch = new_epoch
        self._tracker = JobTracker(config.world_size)
        self.weights = weights if weights is not None else WeightsState(1, fixed=b"")
        self.requests = RequestTable(
            namespace,
            config.hashes_per_chunk,
            self._tracker,
            self.metrics,
            self.weights,
            groups=len(config.kv_groups),
        )
        self.deferral = DeferralClock(config, self.metrics, clock)
        self.cost = CostModel(
            prefill_tokens_per_s=config.prefill_tokens_per_s,
            always=config.load_policy == "always",
            in_flight=self._tracker.jobs,
            clock=self._now,
        )
        ctx = Context(
            config,
            directory,
            self.tiers,
            self.requests,
            self.deferral,
            self.stats,
            self.metrics,
            self.anomalies,
            self.cost,
            self.weights,
        )
        self.loads = LoadPlanner(ctx)
        self.stores = StorePlanner(ctx)
        self.moves = TierMoves(ctx)
        self.builder = StepBuilder(ctx, self.loads, self.stores, self.moves)
        self.allocations = Allocations(ctx, self.loads, self.builder)
        self.completions = Completions(ctx, self.metrics, (self.loads, self.stores, self.moves))

    @property
    def clock(self) -> Callable[[], float]:
        """The time source of the deferral bound and of the prefill speed the cost
        model measures (harnesses substitute logical time)."""
        return self.deferral.clock

    @clock.setter
    def clock(self, clock: Callable[[], float]) -> None:
        self.deferral.clock = clock

    def _now(self) -> float:
        return self.deferral.clock()  # the substituted clock too

    @property
    def epoch(self) -> bytes:
        """The key epoch: changes at every reset (decision 0005) and whenever the
        weights' fingerprints change (decision 0019)."""
        return self.weights.epoch

    @property
    def param_errors(self) -> ParamErrorLog:
        return self.requests.param_errors

    # ------------------------------------------------------------------ lookup

    def lookup(self, request: EngineRequest, num_computed_tokens: int) -> int | None:
        """Tokens loadable past ``num_computed_tokens``, 0 on a miss, or RETRY_LATER.

        Clears the request's stale block ids first. A request with transfer jobs in
        flight gets RETRY_LATER without the directory being consulted, until its
        deferral bound is reached (then 0: recompute). A hit of less than one chunk
        past the local hit counts as 0. Changes no directory state.
        """
        self.metrics.count("lookups_total", tier="host")
        state = self.requests.get(request.request_id)
        if state is None:
            state = self.requests.new(request)
        elif state.finished:
            self.anomalies.note(
                Anomaly.REUSED_REQUEST_ID,
                f"request {request.request_id!r} arrived while an earlier request of that id "
                "still drains its stores; it is served without offloading",
            )
            return 0
        elif state.phase is Phase.RUNNING:
            self.on_preempted(request.request_id)  # only a preempted request is re-looked-up
        state.request = request
        state.blocks.clear()
        unallocated = state.lookup_hit is not None  # answered, not admitted since
        state.lookup_hit, state.lookup_tier = None, None
        answer = self.loads.answer(state, request, num_computed_tokens)
        return self.loads.unstall(state, answer, unallocated)

    # -------------------------------------------------------------- allocation

    def on_allocated(
        self, request: EngineRequest, blocks: GroupBlocks, num_external_tokens: int
    ) -> None:
        """The engine allocated ``blocks`` (the request's whole allocation, one block
        list per KV cache group) and will load ``num_external_tokens`` into them: an
        admission, whatever lookup answered (see
        :mod:`kvoffload.core.scheduler.allocations`). Never raises."""
        self.allocations.on_allocated(request, blocks, num_external_tokens)

    def load_sources(self, request_id: str, tokens: int) -> dict[str, int]:
        """The tiers (by name; ``"host"`` for host memory) that supply ``tokens`` of the
        load just planned for ``request_id`` at its allocation (vLLM asks right after
        :meth:`on_allocated`), as :func:`~.load_jobs.load_sources` splits them; empty
        when no load of the request waits in this step. Read-only; never raises."""
        for job in reversed(self.builder.pending_loads):
            if job.request_id == request_id:
                return load_sources(job, tokens)
        return {}

    # ------------------------------------------------------------ end of a request

    def on_preempted(self, request_id: str) -> None:
        """The engine freed a running request's blocks and re-queued it (see
        :meth:`StepBuilder.preempt`). Idempotent; ignored unless it is running."""
        self.builder.preempt(request_id)

    def on_finished(self, request_id: str) -> None:
        """The request finished or was aborted; the engine frees its blocks now (see
        :meth:`StepBuilder.finish`). Idempotent."""
        self.builder.finish(request_id)

    on_aborted = on_finished

    # ------------------------------------------------------------------ the plan

    def build_plan(self, step: StepInput) -> StepPlan:
        """The plan for this engine step (see :class:`StepPlan` and
        :class:`StepBuilder`). The cost model times the engine's steps here."""
        tokens = sum(s.num_scheduled_tokens for s in step.scheduled)
        self.cost.on_step(self.deferral.clock(), tokens)
        return self.builder.build(step)

    def on_report(self, report: WorkerReport) -> list[Completion]:
        """Apply one worker's results; return the jobs that completed (all workers
        reported). Unknown and repeated results are ignored and counted."""
        return self.completions.apply(report)

    # ------------------------------------------------------------------ the rest

    def reset(self) -> None:
        """Forget every offloaded chunk in every tier (vLLM's connector reset: the
        weights changed). A new key epoch begins (decision 0005): the keys of chunks
        stored before, in any tier or by jobs still in flight, are never computed
        again, so nothing stored before the reset is served after it. The directories
        drop what they hold; jobs in flight still complete and release their requests,
        and what they stored is dropped."""
        self.weights.reset(self._new_epoch())
        self.directory.reset()
        self.tiers.reset()
        self._rekey()
        self.metrics.count("resets_total")

    # ------------------------------------------------------------------ weights

    def check_weights(self) -> None:
        """The weights may have changed in place (the engine's prefix cache was
        reset): every worker fingerprints its weights again before it runs the next
        plan's jobs, refuses that plan's loads and stores if they no longer match the
        keys, and reports; lookups go on meanwhile (decision 0019)."""
        if not self.weights.fixed:
            self.weights.request_check()
            self.metrics.count("weights_checks_total")

    def on_weights(self, rank: int, check: int, fingerprint: bytes) -> WeightsChange | None:
        """Worker ``rank`` fingerprinted its weights for check ``check``. Once every
        worker reported the latest check: weights seen for the first time, or other
        than before, begin a new key epoch (nothing stored under other weights is
        found; every live request's KV is the old weights' and is never stored, as
        after a connector reset, but no tier is emptied: other engines may still run
        the old weights). Returns the change, or None (waiting for other ranks, a
        report of an older check)."""
        change = self.weights.report(rank, check, fingerprint)
        if change is not None and change.changed:
            self._rekey()
            if not change.first:
                self.metrics.count("weights_changes_total")
        return change

    def _rekey(self) -> None:
        for state in self.requests:
            state.rekey(self.namespace, self.weights.epoch)

    def take_events(self) -> list[CacheEvent]:
        events = self.directory.take_events()
        for tier in self.tiers.tiers.values():
            events += tier.take_events()
        return events

    @property
    def step(self) -> int:
        return self.builder.step

    def has_pending_work(self) -> bool:
        """True while the engine must keep stepping for kvoffload: jobs in flight,
        final stores of FINISHING requests not yet planned, or timed-out tier jobs
        whose I/O has not returned (their slots stay reserved until a report says
        it did). An idle engine that stopped stepping would never deliver them."""
        return bool(
            len(self._tracker)
            or self.builder.has_pending()
            or self.tiers.has_queued()
            or self.moves.quarantine
        )

    def new_job_id(self) -> int:
        """A job id never handed out before (for jobs the engine adapter makes itself)."""
        return self._tracker.new_id()

    def take_unplanned_loads(self) -> list[EngineJob]:
        """Loads emitted by ``on_allocated`` and not yet shipped in a plan (the adapter
        takes them when it stops offloading after an internal error)."""
        return self.builder.take_loads()

    def jobs_in_flight(self) -> list[TransferJob]:
        return self._tracker.jobs()

    def jobs_of(self, request_id: str) -> tuple[TransferJob, ...]:
        """The request's jobs in flight (see :meth:`JobTracker.jobs_of`)."""
        return self._tracker.jobs_of(request_id)

    def state_of(self, request_id: str) -> RequestState | None:
        return self.requests.get(request_id)

    def request_ids(self) -> list[str]:
        return self.requests.ids()

    def check_integrity(self) -> None:
        """Verify every scheduler-half and directory invariant (tests, debug runs)."""
        verify_scheduler(
            self.requests.as_dict(),
            self._tracker,
            self.directory,
            self.tiers,
            self.moves.quarantine.jobs(),
        )
