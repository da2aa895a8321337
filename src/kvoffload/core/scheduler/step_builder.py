"""The step builder: what happens between two plans, and the plan it becomes.

The engine's calls between two ``build_plan`` calls contribute to the next plan:
loads emitted at allocation, stores of preempted requests to flush, blocks handed
out fresh at allocation or scheduling (which fence in-flight stores reading them),
requests that finished with a final store to plan, promotions lookups wished.
:class:`StepBuilder` is the one owner of those accumulators; :meth:`build` turns
them and the engine's :class:`StepInput` into the frozen :class:`StepPlan` and starts afresh.
"""

from __future__ import annotations

from kvoffload.core.jobs import EngineJob, StepPlan
from kvoffload.core.observe.anomalies import Anomaly
from kvoffload.core.scheduler.block_tables import GroupBlocks
from kvoffload.core.scheduler.context import Context
from kvoffload.core.scheduler.loads import LoadPlanner
from kvoffload.core.scheduler.request_state import Phase, RequestState
from kvoffload.core.scheduler.stores import StorePlanner
from kvoffload.core.scheduler.tier_moves import TierMoves
from kvoffload.core.scheduler_types import (
    ScheduledRequest,
    StepInput,
)

_SCHEDULABLE = (Phase.WAITING, Phase.RUNNING, Phase.PREEMPTED_DRAINING)


class StepBuilder:
    def __init__(
        self, ctx: Context, loads: LoadPlanner, stores: StorePlanner, moves: TierMoves
    ) -> None:
        self.config = ctx.config
        self.requests = ctx.requests
        self.deferral = ctx.deferral
        self.metrics = ctx.metrics
        self.anomalies = ctx.anomalies
        self.loads = loads
        self.stores = stores
        self.moves = moves
        self.step = 0
        self.pending_loads: list[EngineJob] = []
        self._flush: set[int] = set()
        self._fresh_blocks: set[int] = set()
        self._finishing: list[str] = []

    # ------------------------------------------------------------ between plans

    def add_load(self, job: EngineJob) -> None:
        self.pending_loads.append(job)
        self._fresh_blocks.update(job.moved_blocks() or job.invalid_blocks)

    def add_allocation(self, blocks: GroupBlocks, held_tokens: int) -> None:
        """The engine allocated ``blocks`` to a request whose own prefix-cache hit is
        ``held_tokens``: every block past that hit is fresh, whoever fills it
        (kvoffload's load, another connector's beside kvoffload in a
        ``MultiConnector``, or the forward pass), so an in-flight store still
        reading one is fenced in the next plan, which the workers flush before any
        connector's load starts."""
        held = held_tokens // self.config.block_size
        for table in blocks:
            self._fresh_blocks.update(table[held:])

    def finish(self, request_id: str) -> None:
        """The request finished or was aborted; the engine frees its blocks now.

        A running request is FINISHING: its last full chunks are stored by the next
        plan (the freed blocks are fenced), which moves it to FINISHED_DRAINING or
        DONE. Any other is FINISHED_DRAINING while jobs are in flight; the state is
        dropped once none is. Idempotent."""
        state = self.requests.get(request_id)
        if state is None or state.finished or state.phase is Phase.DONE:
            return
        if state.phase is Phase.RUNNING:
            state.computed_tokens = min(state.computed_tokens, state.request.num_computed_tokens)
            state.move(Phase.FINISHING)
            self._finishing.append(request_id)
        elif self.requests.tracker.has_jobs(request_id):
            state.move(Phase.FINISHED_DRAINING)
        else:
            self.requests.drop(state)

    def preempt(self, request_id: str) -> None:
        """The engine freed a running request's blocks and re-queued it: its stores
        are flushed in the next plan, and it is looked up again only once its jobs
        (stores, or a promotion from before its admission) drained. Idempotent;
        ignored unless the request is running."""
        state = self.requests.get(request_id)
        if state is None or state.phase is not Phase.RUNNING:
            return
        state.blocks.clear()
        tracker = self.requests.tracker
        self._flush.update(tracker.store_ids(request_id))
        self.metrics.count("preemptions_total")
        busy = tracker.has_jobs(request_id)
        state.move(Phase.PREEMPTED_DRAINING if busy else Phase.WAITING)

    def has_pending(self) -> bool:
        return bool(self._finishing or self.pending_loads or self.loads.wished)

    def take_loads(self) -> list[EngineJob]:
        loads, self.pending_loads = self.pending_loads, []
        return loads

    # ------------------------------------------------------------ the plan

    def build(self, step: StepInput) -> StepPlan:
        """The plan for this engine step (see :class:`StepPlan`)."""
        self.step += 1
        self.deferral.tick(bool(step.scheduled))
        for request_id in step.preempted:
            self.preempt(request_id)
        # Spills first: they pin chunks whose host store just completed, so this
        # step's new stores cannot evict them before they are written down.
        spills = self.moves.plan_spills()
        stores: list[EngineJob] = []
        for sched in step.scheduled:
            state = self.requests.get(sched.request_id)
            if state is None or state.phase not in _SCHEDULABLE:
                phase = "unknown" if state is None else state.phase.name
                self.anomalies.note(
                    Anomaly.UNTRACKED_REQUEST,
                    f"request {sched.request_id!r} scheduled while {phase} here; not offloaded",
                )
                continue
            self._scheduled(state, sched)
            self._store(state, stores)
        for request_id in self._finishing:
            state = self.requests.get(request_id)
            if state is not None and state.phase is Phase.FINISHING:
                self._store(state, stores)
                if self.requests.tracker.has_jobs(request_id):
                    state.move(Phase.FINISHED_DRAINING)
                else:
                    self.requests.drop(state)
        wished, self.loads.wished = self.loads.wished, []
        promotions = self.moves.plan_promotions(wished)
        planned = {job.job_id for job in stores}
        flush = self.stores.flush_set(self._flush, self._fresh_blocks, planned)
        plan = StepPlan(
            self.step,
            tuple(self.take_loads()),
            tuple(stores),
            frozenset(flush),
            spills=tuple(spills),
            promotions=tuple(promotions),
        )
        self._flush, self._fresh_blocks, self._finishing = set(), set(), []
        return plan

    def _scheduled(self, state: RequestState, sched: ScheduledRequest) -> None:
        """The engine runs the request this step: its blocks and computed tokens."""
        if sched.replace:
            state.blocks.replace(sched.block_ids)
            held = sched.num_computed_tokens // self.config.block_size
            for table in sched.block_ids:
                self._fresh_blocks.update(table[held:])
        else:
            state.blocks.extend(sched.block_ids)
            for table in sched.block_ids:
                self._fresh_blocks.update(table)
        state.computed_tokens = sched.num_computed_tokens + sched.num_scheduled_tokens
        state.scheduled_from = sched.num_computed_tokens
        self.deferral.end(state)
        state.move(Phase.RUNNING)

    def _store(self, state: RequestState, out: list[EngineJob]) -> None:
        job = self.stores.plan(state)
        if job is not None:
            out.append(job)
