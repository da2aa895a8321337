"""The scheduler half: per-request state machines, transfer jobs, the per-step plan.

One instance per engine. The engine (the vLLM adapter or the reference engine)
calls, in each scheduling pass:

1. ``lookup(request, num_computed_tokens)`` for waiting requests: tokens loadable past
   the engine's own prefix hit, or :data:`RETRY_LATER`;
2. ``on_allocated(request, block_ids, num_external_tokens)`` once blocks are
   allocated (emits one load job when ``num_external_tokens > 0``); the engine has
   the last word: every request it allocates for is tracked, whatever lookup said;
3. ``on_finished(request_id)`` / ``on_aborted`` when a request ends (its blocks are
   freed at once; final stores are planned from them and fenced);
4. ``build_plan(StepInput)`` at the end of the pass: the :class:`StepPlan` for every
   worker;

and ``on_report(WorkerReport)`` for each worker's output when it arrives, which may
be one step late (asynchronous scheduling).

Correct by construction under every interleaving of those calls:

- A request with any job in flight is never looked up in the directory: lookup
  answers retry later, bounded by ``max_deferral_steps`` busy steps (idle ones do not
  count) or ``max_deferral_seconds``; past the bound it answers 0 and the request
  recomputes: no load is ever issued on top of its stores (decision 0002).
- Every in-flight store fences its source blocks: a store whose block is handed out
  fresh in a step (to any request, or as a load destination) is in that step's
  ``flush`` set, so the worker finishes it before the block is written.
- Jobs complete exactly once (all workers reported). A failed load unpins its chunks
  (the engine recomputes its blocks); a failed store frees its slots. Nothing in a
  failure path raises; surprising input is an anomaly (decision 0006).

Owned state: the request states, the job tracker and the directory; callers receive
immutable plans and completions.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

from kvoffload.core.anomalies import Anomaly, AnomalyLog, ParamErrorLog
from kvoffload.core.directory import Directory
from kvoffload.core.events import CacheEvent
from kvoffload.core.job_tracker import Completion, JobTracker
from kvoffload.core.jobs import JobKind, TransferJob, WorkerReport
from kvoffload.core.keys import Namespace
from kvoffload.core.load_planning import next_chunks_wait, plan_load_job
from kvoffload.core.metrics import MetricsRecorder
from kvoffload.core.request_controls import parse_controls
from kvoffload.core.request_state import Phase, RequestState
from kvoffload.core.scheduler_checks import verify_scheduler
from kvoffload.core.scheduler_types import (
    RETRY_LATER,
    Deferral,
    EngineRequest,
    SchedulerConfig,
    SchedulerStats,
)
from kvoffload.core.step_planning import StepPlanning
from kvoffload.core.tier_planning import TierPlanner
from kvoffload.core.tiering import LowerTier


class OffloadScheduler(StepPlanning):
    """The engine-agnostic scheduler half of kvoffload (see the module docstring)."""

    def __init__(
        self,
        config: SchedulerConfig,
        directory: Directory,
        namespace: Namespace,
        *,
        lower_tiers: Sequence[LowerTier] = (),
        spill_after_hits: int = 0,
        clock: Callable[[], float] = time.monotonic,
        new_epoch: Callable[[], bytes] = lambda: os.urandom(16),
    ) -> None:
        self.config = config
        self.directory = directory
        self.namespace = namespace
        self.tiers = TierPlanner(
            directory, lower_tiers, config.blocks_per_chunk, spill_after_hits=spill_after_hits
        )
        self.stats = SchedulerStats()
        self.metrics = MetricsRecorder()
        self.anomalies = AnomalyLog()
        self.param_errors = ParamErrorLog()
        self.epoch = b""  # the key epoch: changes at every reset (decision 0005)
        self._new_epoch = new_epoch
        self.clock = clock  # the deferral bound's time source (harnesses: logical time)
        self._states: dict[str, RequestState] = {}
        self._tracker = JobTracker(config.world_size)
        self._step = 0
        self._busy_steps = 0  # steps that scheduled work: the deferral bound counts these
        self._pending_loads: list[TransferJob] = []
        self._pending_flush: set[int] = set()
        self._fresh_blocks: set[int] = set()
        self._finishing: list[str] = []
        self._promotions: list[str] = []

    # ------------------------------------------------------------------ lookup

    def lookup(self, request: EngineRequest, num_computed_tokens: int) -> int | None:
        """Tokens loadable past ``num_computed_tokens``, 0 on a miss, or RETRY_LATER.

        Clears the request's stale block ids first. A request with transfer jobs in
        flight gets RETRY_LATER without the directory being consulted, until its
        deferral bound is reached (then 0: recompute). A hit of less than one chunk
        past the local hit counts as 0. Changes no directory state.
        """
        self.stats.lookups += 1
        state = self._states.get(request.request_id)
        if state is None:
            state = self._new_state(request)
        elif state.phase is Phase.FINISHED_DRAINING:
            self.anomalies.note(
                Anomaly.REUSED_REQUEST_ID,
                f"request {request.request_id!r} arrived while an earlier request of that id "
                "still drains its stores; it is served without offloading",
            )
            return 0
        elif state.phase is Phase.RUNNING:
            self.on_preempted(request.request_id)  # only a preempted request is re-looked-up
        state.request = request
        state.block_ids.clear()
        state.lookup_hit = None
        if getattr(request, "skip_reading_prefix_cache", False) or not state.controls.load:
            # The engine serves this request no cached KV whatever the answer (or the
            # request said so): never defer or promote for it (its chunks are still
            # stored once computed, unless it said otherwise).
            state.lookup_hit = (num_computed_tokens, 0)
            return 0
        if state.jobs and not self.config.testing_disable_inflight_deferral:
            if state.has_load() or not self._deferral_expired(state):
                promoting = state.has_promotion()
                self._defer(state, Deferral.PROMOTION if promoting else Deferral.TRANSFER_IN_FLIGHT)
                return RETRY_LATER
            self.stats.deferral_timeouts += 1
            state.lookup_hit = (num_computed_tokens, 0)
            return 0
        chunk = self.config.chunk_tokens
        keys = state.keys.extend(request.block_hashes)
        cap = state.controls.load_chunks(chunk)
        if cap is not None:
            keys = keys[:cap]  # the request's max_load_tokens
        if state.load_failed or not keys:
            state.lookup_hit = (num_computed_tokens, 0)
            return 0
        readable = self.directory.readable_prefix(keys)
        if readable < len(keys) and readable * chunk >= num_computed_tokens:
            reason, wished = next_chunks_wait(
                state,
                keys,
                readable,
                num_computed_tokens,
                directory=self.directory,
                tiers=self.tiers,
                chunk_tokens=chunk,
            )
            if wished:
                self._promotions.append(state.request_id)
            if reason is not None:
                if not self._deferral_expired(state):
                    self._defer(state, reason)
                    return RETRY_LATER
                self.stats.deferral_timeouts += 1
                state.promotion = None
                state.no_promotion = True  # take what host memory has now
        external = readable * chunk - num_computed_tokens
        if external < chunk or num_computed_tokens % self.config.block_size:
            external = 0
        state.lookup_hit = (num_computed_tokens, external)
        return external

    def _deferral_expired(self, state: RequestState) -> bool:
        if state.deferred_since_step is None or state.deferred_since_s is None:
            return False
        return (
            self._busy_steps - state.deferred_since_step >= self.config.max_deferral_steps
            or self.clock() - state.deferred_since_s >= self.config.max_deferral_seconds
        )

    def _defer(self, state: RequestState, reason: Deferral) -> None:
        if state.deferred_since_step is None:
            state.deferred_since_step = self._busy_steps
            state.deferred_since_s = self.clock()
        state.deferral_reason = reason
        self.stats.deferrals[reason] = self.stats.deferrals.get(reason, 0) + 1

    # -------------------------------------------------------------- allocation

    def on_allocated(
        self, request: EngineRequest, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        """The engine allocated ``block_ids`` (the request's whole allocation) and will
        load ``num_external_tokens`` into them.

        The engine has the last word: whatever lookup answered, the request is tracked
        from here with its full block list. After a lookup this is an admission: a hit
        the engine accepted emits one load job, anything else admits the request to
        run. Without one (vLLM resuming a request whose load landed) only the block
        list is refreshed. Never raises on surprising input: an allocation of another
        hit than offered, or a load into the null block or a block named twice, is an
        anomaly whose blocks are reported invalid, so the engine recomputes them."""
        state = self._states.get(request.request_id)
        if state is None:
            state = self._new_state(request)
        elif state.phase is Phase.FINISHED_DRAINING:
            return  # a reused request id (counted at lookup): not offloaded
        state.request = request
        hit, state.lookup_hit = state.lookup_hit, None
        local, offered = hit if hit is not None else (0, 0)
        if num_external_tokens and not offered:
            self.anomalies.note(
                Anomaly.EXTERNAL_TOKENS,
                f"request {request.request_id!r}: {num_external_tokens} external tokens "
                "allocated, none offered; nothing loaded",
            )
        if hit is None and state.phase in (Phase.RUNNING, Phase.LOADING):
            state.block_ids = list(block_ids)  # resumed after its load: same admission
            return
        self._admit(state, local + num_external_tokens, block_ids)
        if not (num_external_tokens and offered):
            state.move(Phase.RUNNING)
            return
        job = plan_load_job(
            state,
            local,
            num_external_tokens,
            offered=offered,
            block_ids=block_ids,
            config=self.config,
            directory=self.directory,
            new_id=self._tracker.new_id,
            anomalies=self.anomalies,
        )
        self._track(state, job)
        self._pending_loads.append(job)
        self._fresh_blocks.update(job.block_ids or job.invalid_blocks)
        state.move(Phase.LOADING)
        if job.keys:
            self.stats.loads += 1
            self.stats.loaded_chunks += len(job.keys)
            self.stats.lookup_hit_tokens += num_external_tokens

    def _admit(self, state: RequestState, hit_tokens: int, block_ids: Sequence[int]) -> None:
        """Admission bookkeeping: recency of the hit, reuse counts, the end of any
        deferral, a fresh store cursor and the full block list."""
        keys = state.keys.extend(state.request.block_hashes)
        self.directory.touch(keys[: hit_tokens // self.config.chunk_tokens])
        self.directory.record_lookups(keys)
        self._end_deferral(state)
        state.stored_chunks = 0
        state.promotion = None
        state.no_promotion = False
        state.stale_kv = False  # computed (or loaded) afresh from here
        state.block_ids = list(block_ids)

    # ------------------------------------------------------------ end of a request

    def on_finished(self, request_id: str) -> None:
        """The request finished or was aborted; the engine frees its blocks now.

        A running request's last full chunks are stored by the next plan (the freed
        blocks are fenced). The state is dropped once no job is in flight."""
        state = self._states.get(request_id)
        if state is None or state.phase in (Phase.FINISHED_DRAINING, Phase.DONE):
            return
        if state.phase is Phase.RUNNING:
            state.computed_tokens = min(state.computed_tokens, state.request.num_computed_tokens)
            state.final_store_pending = True
            self._finishing.append(request_id)
        if state.jobs or state.final_store_pending:
            state.move(Phase.FINISHED_DRAINING)
        else:
            self._drop(state)

    on_aborted = on_finished

    # ------------------------------------------------------------------ reports

    def on_report(self, report: WorkerReport) -> list[Completion]:
        """Apply one worker's results; return the jobs that completed (all workers
        reported). Unknown and repeated results are ignored and counted."""
        done: list[Completion] = []
        for result in report.results:
            job = self._tracker.job(result.job_id)
            if job is not None:
                tier = job.tier or "host"
                self.metrics.observe_transfer(job.kind.value, tier, result.nbytes, result.seconds)
            completion = self._tracker.record(report.rank, result)
            if completion is None:
                if result.job_id not in self._tracker:
                    self.stats.stale_completions += 1
                continue
            self._complete(completion)
            done.append(completion)
        return done

    def _complete(self, completion: Completion) -> None:
        job = completion.job
        if not job.kind.touches_engine:
            self.tiers.complete(job, completion.result)
        elif job.kind is JobKind.STORE:
            self.directory.complete_store(job.keys, completion.success)
            self.stats.store_failures += not completion.success
            self.stats.failed_store_chunks += 0 if completion.success else len(job.keys)
            if completion.success:
                self.tiers.note_stored(job.keys)
        else:
            self.directory.complete_load(job.keys)
            if not completion.success:
                # The copy may be torn: nobody loads these chunks again, and this
                # request recomputes instead of retrying (no retry loops).
                self.directory.discard(job.keys)
                self.stats.load_failures += 1
                self.stats.failed_load_chunks += len(job.keys)
            else:
                self.tiers.note_loaded(job.keys)
        state = self._states.get(job.request_id)
        if state is None:
            return
        if job.kind is JobKind.LOAD and not completion.success:
            state.load_failed = True
        del state.jobs[job.job_id]
        if job.kind is JobKind.LOAD and state.phase is Phase.LOADING:
            state.move(Phase.RUNNING)
        if job.kind is JobKind.PROMOTE:
            if not completion.success or completion.result.failed_chunks:
                state.no_promotion = True  # take what arrived; no retry loop on a bad tier
            if state.phase is Phase.PROMOTING:
                state.move(Phase.WAITING)
        if state.jobs:
            return
        if state.phase is Phase.PREEMPTED_DRAINING:
            state.move(Phase.WAITING)
        elif state.phase is Phase.FINISHED_DRAINING and not state.final_store_pending:
            self._drop(state)

    # ------------------------------------------------------------------ the rest

    def reset(self) -> None:
        """Forget every offloaded chunk in every tier (vLLM's connector reset: the
        weights changed). A new key epoch begins (decision 0005): the keys of chunks
        stored before, in any tier or by jobs still in flight, are never computed
        again, so nothing stored before the reset is served after it. The directories
        drop what they hold; jobs in flight still complete and release their requests,
        and what they stored is dropped."""
        self.epoch = self._new_epoch()
        self.directory.reset()
        self.tiers.reset()
        for state in self._states.values():
            state.rekey(self.namespace, self.epoch)
        self.stats.resets += 1

    def _new_state(self, request: EngineRequest) -> RequestState:
        controls, refused = parse_controls(getattr(request, "kv_transfer_params", None))
        if refused is not None:
            self.param_errors.note(request.request_id, refused)
        state = RequestState(
            request, self.namespace, self.config.hashes_per_chunk, self.epoch, controls
        )
        self._states[request.request_id] = state
        return state

    def take_events(self) -> list[CacheEvent]:
        events = self.directory.take_events()
        for tier in self.tiers.tiers.values():
            events += tier.take_events()
        return events

    @property
    def step(self) -> int:
        return self._step

    def has_pending_work(self) -> bool:
        """True while the engine must keep stepping for kvoffload: jobs in flight,
        or final stores of finished requests not yet planned. An idle engine that
        stopped stepping would never deliver their completions."""
        return bool(
            len(self._tracker)
            or self._finishing
            or self._pending_loads
            or self._promotions
            or self.tiers.has_queued()
        )

    def new_job_id(self) -> int:
        """A job id never handed out before (for jobs the engine adapter makes itself)."""
        return self._tracker.new_id()

    def take_unplanned_loads(self) -> list[TransferJob]:
        """Loads emitted by ``on_allocated`` and not yet shipped in a plan (the adapter
        takes them when it stops offloading after an internal error)."""
        loads, self._pending_loads = self._pending_loads, []
        return loads

    def jobs_in_flight(self) -> list[TransferJob]:
        return self._tracker.jobs()

    def state_of(self, request_id: str) -> RequestState | None:
        return self._states.get(request_id)

    def request_ids(self) -> list[str]:
        return list(self._states)

    def check_integrity(self) -> None:
        """Verify every scheduler-half and directory invariant (tests, debug runs)."""
        verify_scheduler(self._states, self._tracker, self.directory, self.tiers)
