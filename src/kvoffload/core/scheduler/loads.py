"""The load family: lookup's answer, the load job of an admitted hit, its completion.

:class:`LoadPlanner` owns both ends of a load: it answers lookups from the host
directory and the lower tiers (waiting for a pending store, or for a lower tier that
cannot tell yet, when that can still make a hit), plans the one load job of an
admitted hit (pinning its host chunks; its chunks a lower tier holds are read from
there, a *tier load*, booked in the tier), and completes it (unpinning; a failed load
discards its host chunks, whose copies may be torn, unless the failure was the tier's
chunks, which the tier then forgets). With ``direct_tier_loads`` off, a lower tier's
run is instead promoted into host memory first while the request waits. With
``load_policy`` ``cost`` a lower tier's part of a hit (the tail past the host-held
head) is offered only when the cost model says loading it beats recomputing it
(:meth:`LoadPlanner.worth`; decision 0013): a declined part is recomputed at once,
never waited for, except now and then its first chunk, loaded as its lane's probe (the
cost model's bound), which re-measures a lane that may have turned fast. The
host-held head is always loaded (a host copy is memcpy-fast).
What lookup finds past the host prefix is :mod:`.below_host`; the load job of an
admitted hit is built by :mod:`.load_jobs`.
"""

from __future__ import annotations

from kvoffload.core.cost import Decline
from kvoffload.core.identity.weights import FENCED
from kvoffload.core.jobs import ASLEEP, NO_SLOT, EngineJob
from kvoffload.core.scheduler.below_host import Take, TierHit, next_chunks_wait
from kvoffload.core.scheduler.block_tables import GroupBlocks
from kvoffload.core.scheduler.context import Context
from kvoffload.core.scheduler.group_chunks import (
    readable_chunks,
)
from kvoffload.core.scheduler.job_tracker import Completion
from kvoffload.core.scheduler.load_jobs import plan_load_job
from kvoffload.core.scheduler.request_state import Phase, RequestState
from kvoffload.core.scheduler_types import (
    RETRY_LATER,
    Deferral,
    EngineRequest,
)

IDLE_STEPS_STALLED = 2
"""Consecutive engine steps that scheduled nothing after which a request the engine
looked up and did not admit is taken for a stalled engine (one such step happens in a
batch queue's rhythm)."""


LOOKUP_GRACE_STEPS = 2
"""Engine steps a lower tier that cannot tell yet (a remote index's round trip in
flight) is always given to answer under ``load_policy`` ``cost``: an answer normally
comes within a step, however short recomputing the tail would be."""


class LoadPlanner:
    """Lookup answers, load jobs and their completion (see the module docstring)."""

    def __init__(self, ctx: Context) -> None:
        self.config = ctx.config
        self.directory = ctx.directory
        self.tiers = ctx.tiers
        self.requests = ctx.requests
        self.deferral = ctx.deferral
        self.weights = ctx.weights
        self.stats = ctx.stats
        self.metrics = ctx.metrics
        self.anomalies = ctx.anomalies
        self.cost = ctx.cost
        self.wished: list[str] = []  # requests whose promotion a lookup wished this step

    def _wait(
        self,
        state: RequestState,
        reason: Deferral,
        local_only: tuple[int, int],
        *,
        bounded: bool = True,
    ) -> int | None:
        """RETRY_LATER for ``reason``, until the deferral bound when ``bounded`` (a
        load in flight is waited for whatever the bound); past it 0: the request
        recomputes (counted)."""
        if not bounded or not self.deferral.expired(state):
            self.deferral.defer(state, reason)
            return RETRY_LATER
        self.metrics.count("deferral_timeouts_total")
        state.lookup_hit = local_only
        return 0

    def answer(
        self, state: RequestState, request: EngineRequest, num_computed_tokens: int
    ) -> int | None:
        """Tokens loadable past ``num_computed_tokens``, 0, or RETRY_LATER, for a
        request whose stale block ids were just cleared. Records the offer in
        ``state.lookup_hit``; changes no directory state."""
        local_only = (num_computed_tokens, 0)
        if getattr(request, "skip_reading_prefix_cache", False) or not state.controls.load:
            # The engine serves this request no cached KV whatever the answer (or the
            # request said so): never defer or promote for it (its chunks are still
            # stored once computed, unless it said otherwise).
            state.lookup_hit = local_only
            return 0
        tracker, request_id = self.requests.tracker, state.request_id
        if tracker.has_jobs(request_id) and not self.config.testing_disable_inflight_deferral:
            promoting = tracker.has_promotion(request_id)
            busy = Deferral.PROMOTION if promoting else Deferral.TRANSFER_IN_FLIGHT
            return self._wait(state, busy, local_only, bounded=not tracker.has_load(request_id))
        if not self.weights.known:
            # The keys may not name the weights the workers run (decision 0019): wait
            # for their fingerprints (a step or two), then recompute past the bound.
            return self._wait(state, Deferral.WEIGHTS, local_only)
        chunk = self.config.chunk_tokens
        keys = state.keys.extend(request.block_hashes)
        cap = state.controls.load_chunks(chunk)
        if cap is not None:
            keys = keys[:cap]  # the request's max_load_tokens
        if state.load_failed or not keys:
            state.lookup_hit = local_only
            return 0
        groups = self.config.kv_groups
        readable = readable_chunks(
            self.directory, groups, keys, num_computed_tokens // chunk, chunk
        )
        if readable < len(keys) and readable * chunk >= num_computed_tokens:
            reason, wished = next_chunks_wait(
                state,
                keys,
                readable,
                num_computed_tokens,
                directory=self.directory,
                tiers=self.tiers,
                config=self.config,
                take=lambda tier, n, tokens: self.worth(state, tier, n, tokens),
                waits=lambda tier: self.waits_for(state, tier, len(keys) - readable),
            )
            if wished:
                self.wished.append(state.request_id)
            if isinstance(reason, TierHit):
                state.lookup_tier, readable, reason = reason.tier, reason.chunks, None
            if reason is not None:
                if not self.deferral.expired(state):
                    self.deferral.defer(state, reason)
                    return RETRY_LATER
                self.metrics.count("deferral_timeouts_total")
                state.promotion = None
                state.no_promotion = True  # take what host memory has now
        external = readable * chunk - num_computed_tokens
        if external < chunk or num_computed_tokens % self.config.block_size:
            external = 0
        if external and self._beside_a_load_holder(state):
            return self._wait(state, Deferral.LOAD_HOLDER, local_only)
        state.lookup_hit = (num_computed_tokens, external)
        return external

    def _beside_a_load_holder(self, state: RequestState) -> bool:
        """Whether offering ``state`` a hit now could strand the engine (only where
        ``config.one_load_beside_windows``, vLLM's): it has a sliding-window group,
        another request's load is in flight (LOADING) and no request runs (one that
        runs frees blocks as it ends or is preempted).

        vLLM (0.32, 0.33) admits an async load only if it leaves room for the rest of
        the earlier loads' requests, but counts a window group's null blocks below the
        window as held, so it underestimates that rest; two requests whose loads landed
        can then hold blocks the one at the head of its queue of block holders needs to
        run, and vLLM stops its scan there for good with nothing running (fuzzer seed 276;
        decision 0008). One load at a time on such an idle engine leaves a lone holder,
        which the engine can always complete. The caller defers the hit, bounded (past the
        bound the request recomputes). Read-only."""
        if not (self.config.one_load_beside_windows and self.config.kv_groups.windowed):
            return False
        phases = {other.phase for other in self.requests if other is not state}
        return Phase.LOADING in phases and Phase.RUNNING not in phases

    def unstall(self, state: RequestState, answer: int | None, unallocated: bool) -> int | None:
        """``answer`` (lookup's), unless the engine is stalled on this request.

        ``unallocated``: the request's previous lookup was answered and the engine
        did not admit it. If the engine has run nothing since
        (:data:`IDLE_STEPS_STALLED` steps), only waiting requests hold blocks (e.g.
        requests whose loads landed, queued behind this one) and vLLM stops its scan
        at this request for good: the answer becomes retry-later (vLLM skips the
        request and serves those behind it; the next lookup answers as usual, so the
        request is tried every other step), or, for a hit past the deferral bound,
        0 (an admission without the hit allocates less). While requests run, the
        engine's own back pressure applies, as without kvoffload. Mutates the
        request's offer and deferral only."""
        if answer is None or not unallocated:
            return answer
        if self.deferral.idle_steps < IDLE_STEPS_STALLED:
            return answer
        if answer and self.deferral.expired(state):
            self.metrics.count("deferral_timeouts_total")
            local, _ = state.lookup_hit or (0, 0)
            state.lookup_hit = (local, 0)
            return 0
        self.deferral.defer(state, Deferral.NO_ROOM)
        state.lookup_hit = state.lookup_tier = None
        return RETRY_LATER

    def worth(self, state: RequestState, lane: str, chunks: int, tokens: int) -> Take:
        """Whether ``chunks`` chunks (``tokens`` tokens past what the engine holds) read
        on ``lane`` are worth loading rather than recomputing: always under
        ``load_policy`` ``always`` (the configuration's, or the request's own), else the
        cost model's decision (the engine is shared when the scheduler half tracks
        another request), which moves the lane's verdict. A declined part is loaded in
        part as the lane's probe when the cost model offers it one (counted as
        ``cost_probes_total`` once planned), else recomputed and counted
        (``hits_declined_total``, ``declined_tokens_total``)."""
        if self._loads_always(state):
            return Take.ALL
        decision = self.cost.decide(lane, chunks, tokens, shared=self._shared())
        if decision.decline is None:
            return Take.ALL
        if self.cost.offer_probe(lane, state.request_id):
            return Take.PROBE
        self.metrics.count("hits_declined_total", tier=lane, reason=decision.decline.value)
        self.metrics.count("declined_tokens_total", tokens, tier=lane)
        return Take.NONE

    def waits_for(self, state: RequestState, tier: str, chunks: int) -> bool:
        """Whether lookup waits for lower tier ``tier``'s answer (its index cannot tell
        yet) about the ``chunks`` chunks past the host prefix: always, except under
        ``load_policy`` ``cost`` when loading them from the tier, its lane idle, is
        known to be slower than recomputing them (its estimate, or its unmeasured
        lane's probe in flight for longer: a wait for an answer that would be
        declined), or
        once the request has waited :data:`LOOKUP_GRACE_STEPS` engine steps and longer
        than recomputing them takes (a wait for a slower answer); counted as
        ``hits_declined_total{reason="unanswered"}``."""
        if self._loads_always(state):
            return True
        recompute_s = self.cost.recompute_s(
            chunks * self.config.chunk_tokens, shared=self._shared()
        )
        if not self.cost.slower(tier, chunks, recompute_s) and (
            self.deferral.waited_steps(state) < LOOKUP_GRACE_STEPS
            or self.deferral.waited_s(state) <= recompute_s
        ):
            return True
        self.metrics.count("hits_declined_total", tier=tier, reason=Decline.UNANSWERED.value)
        return False

    def _loads_always(self, state: RequestState) -> bool:
        """``load_policy`` ``always``: the request's own, else the configuration's."""
        policy = state.controls.load_policy
        return policy == "always" or (policy is None and self.cost.always)

    def _shared(self) -> bool:
        """Other requests share the engine: the scheduler half tracks more than one."""
        return len(self.requests) > 1

    def plan(
        self,
        state: RequestState,
        local: int,
        external: int,
        *,
        offered: int,
        blocks: GroupBlocks,
    ) -> EngineJob:
        """The load of an admitted hit, tracked (see :func:`plan_load_job`)."""
        job = plan_load_job(
            state,
            local,
            external,
            offered=offered,
            blocks=blocks,
            config=self.config,
            directory=self.directory,
            tiers=self.tiers,
            new_id=self.requests.tracker.new_id,
            anomalies=self.anomalies,
        )
        if self.cost.planned(job) and job.tier is not None:
            self.metrics.count("cost_probes_total", tier=job.tier)
        self.requests.tracker.add(job)
        if job.keys:
            self.stats.loads += 1
            host = len(job.host_chunks()) if job.tier is not None else len(job.keys)
            tier_tokens = (len(job.keys) - host) * self.config.chunk_tokens
            if job.tier is not None and job.slots[0] == NO_SLOT:
                tier_tokens -= local % self.config.chunk_tokens  # its first chunk starts inside
            self.metrics.count("transferred_chunks_total", host, direction="load", tier="host")
            self.metrics.count("hit_tokens_total", external - tier_tokens, tier="host")
        return job

    def complete(self, completion: Completion) -> None:
        """The directory side of a finished load: unpin its host chunks (a tier load's
        tier chunks are released in the tier planner); on failure the copy may be
        torn, so nobody loads these host chunks again (and the request recomputes
        instead of retrying: no retry loops) unless only tier chunks failed, or the
        worker refused the load under the weights fence (nothing was copied; the
        chunks are another weights' and never found under the new keys) or while the
        engine slept (nothing was copied: the chunks are good)."""
        job = completion.job
        assert isinstance(job, EngineJob)  # the completions route only loads here
        keys = job.keys if job.tier is None else tuple(job.keys[i] for i in job.host_chunks())
        self.directory.complete_load(keys)
        if job.tier is not None:
            self.tiers.complete_tier_load(job, completion.result)
        if completion.success:
            self.tiers.note_loaded(keys)
            return
        self.stats.load_failures += 1
        if completion.result.failed_chunks:
            return  # the tier's chunks failed (counted under its labels)
        if completion.result.error not in (FENCED, ASLEEP):  # refused: nothing was copied
            self.directory.discard(keys)  # (the chunks may serve engines on other weights)
        self.metrics.count("failed_chunks_total", len(keys), direction="load", tier="host")
