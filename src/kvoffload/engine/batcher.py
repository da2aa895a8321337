"""Batch formation of the reference engine: queues, admission, preemption.

Each step, running requests are served first (in order; when blocks run out the
most recently admitted running request is preempted by recompute, after blocks
held idle by waiting requests were reclaimed, and never while a load in flight
holds the blocks needed: the request then waits a step instead of thrashing).
Waiting requests follow only if nothing was preempted: those already holding
blocks first, then the queue in order, each looked up in kvoffload's scheduler
half and allocated its local prefix hit plus either the blocks its load fills or
those of its first scheduled tokens. Owned by one engine.

Which waiting requests hold blocks, how computed blocks enter the prefix cache
(:mod:`kvoffload.engine.strategies`) and how a request's KV is laid out in blocks (its
block tables, one per KV cache group: :mod:`kvoffload.engine.tables`) are strategies
given to the constructor, with the reference behaviour (one full-attention group) as
default; ``on_admitted`` observes every admission.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

from kvoffload.core.scheduler import OffloadScheduler
from kvoffload.core.scheduler_types import RETRY_LATER, ScheduledRequest
from kvoffload.engine.block_pool import BlockPool
from kvoffload.engine.request import Request, Status
from kvoffload.engine.settings import EngineConfig
from kvoffload.engine.strategies import Holders, QueueScan, RegisterFull, Registration
from kvoffload.engine.tables import OneTable, Tables


class _Admission(enum.Enum):
    ADMITTED = "admitted"  # scheduled from its local hit
    LOADING = "loading"  # a load was issued; it waits for it
    DEFERRED = "deferred"  # lookup said retry later
    NO_BLOCKS = "no_blocks"


class Batcher:
    """See the module docstring. Owns the queues; mutates the requests it schedules
    and the block pool; the strategies are its own (one batcher each)."""

    def __init__(
        self,
        config: EngineConfig,
        pool: BlockPool,
        scheduler: OffloadScheduler | None,
        *,
        holders: Holders | None = None,
        registration: Registration | None = None,
        tables: Tables | None = None,
        on_admitted: Callable[[Request], None] | None = None,
    ) -> None:
        self.config = config
        self.pool = pool
        self.scheduler = scheduler
        self.holders: Holders = holders or QueueScan()
        self.registration: Registration = registration or RegisterFull(pool, config.block_size)
        self.tables: Tables = tables or OneTable(pool, config.block_size)
        self.on_admitted = on_admitted  # called after each admission by a lookup
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.preemptions = 0

    def schedule(self) -> tuple[list[tuple[ScheduledRequest, Request]], tuple[str, ...]]:
        out: list[tuple[ScheduledRequest, Request]] = []
        preempted: list[str] = []
        budget = self.config.token_budget
        for req in list(self.running):
            if req not in self.running or budget == 0:
                continue
            n_new = min(req.target_tokens() - req.num_computed_tokens, budget)
            if n_new <= 0:
                continue
            need = self.tables.need(req, req.num_computed_tokens + n_new)
            for holder in self.holders.idle(self.waiting):
                if self.pool.num_free >= need:
                    break
                self._preempt(holder)
                preempted.append(holder.request_id)
            if self.pool.num_free < need and self.holders.loading(self.waiting):
                continue  # a load holds the blocks: wait for it rather than thrash
            while self.pool.num_free < need and req in self.running:
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
            if req not in self.running:
                continue
            new = self.pool.allocate(max(0, need)) or []
            out.append((self.tables.scheduled(req, new, n_new), req))
            budget -= n_new
        if preempted:
            return out, tuple(preempted)
        # Waiting requests that hold blocks (their load landed) go first, or a request
        # ahead of them that needs those blocks would wait forever.
        holders = self.holders.idle(self.waiting)
        for req in holders + [r for r in self.waiting if r not in holders]:
            if len(self.running) >= self.config.max_running or budget == 0:
                break
            if req.status is Status.WAITING_FOR_LOAD:
                if req.load_ok is None:
                    continue
                self._land_load(req)
            elif not req.block_ids:  # new or preempted: look it up
                admission = self._look_up(req, budget)
                if admission is _Admission.DEFERRED or admission is _Admission.LOADING:
                    continue
                if admission is _Admission.NO_BLOCKS:
                    break
            n_new = min(req.target_tokens() - req.num_computed_tokens, budget)
            need = self.tables.need(req, req.num_computed_tokens + n_new)
            if req in holders and self.pool.num_free < need:
                # Holders must not wait on each other: the later ones give way.
                for other in reversed(self.holders.idle(self.waiting)):
                    if self.pool.num_free >= need:
                        break
                    if other is not req:
                        self._preempt(other)
                        preempted.append(other.request_id)
            fresh = self.pool.allocate(max(0, need))
            if fresh is None:
                if req in holders:
                    continue
                break
            self.waiting.remove(req)
            self.running.append(req)
            req.status = Status.RUNNING
            out.append((self.tables.scheduled(req, fresh, n_new), req))
            budget -= n_new
        return out, tuple(preempted)

    def _look_up(self, req: Request, budget: int) -> _Admission:
        """:meth:`_admit`, then tell the holders and ``on_admitted`` of an admission."""
        admission = self._admit(req, budget)
        if admission is _Admission.ADMITTED or admission is _Admission.LOADING:
            self.holders.admitted(req)
            if self.on_admitted is not None:
                self.on_admitted(req)
        return admission

    def _admit(self, req: Request, budget: int) -> _Admission:
        """Look a new (or preempted) request up; allocate its local hit, and either
        the blocks its load fills or those of its first scheduled tokens."""
        hit = self.tables.cached(req)
        local = hit.tokens
        external = 0
        if self.scheduler is not None:
            answer = self.scheduler.lookup(req, local)
            if answer is RETRY_LATER:
                return _Admission.DEFERRED
            external = answer
        # The blocks the load fills, or those of the first scheduled tokens.
        tokens = local + (external or min(req.target_tokens() - local, budget))
        if not self.tables.admit(req, hit, tokens, local + external):
            return _Admission.NO_BLOCKS
        req.num_computed_tokens = local
        req.whole_allocation_next = True
        if self.scheduler is not None:
            self.scheduler.on_allocated(req, self.tables.tables(req), external)
        if not external:
            return _Admission.ADMITTED
        req.status = Status.WAITING_FOR_LOAD
        req.load = (local, external)
        req.load_ok = None
        # Only the blocks the load fills are allocated: the first scheduled tokens
        # get theirs once the load has landed.
        return _Admission.LOADING

    def _land_load(self, req: Request) -> None:
        """The load was reported: continue from what it brought (or recompute)."""
        local, external = req.load or (req.num_computed_tokens, 0)
        req.num_computed_tokens = local + external if req.load_ok else local
        if req.num_computed_tokens >= req.target_tokens():
            req.num_computed_tokens = req.target_tokens() - 1
        req.num_computed_tokens = self.tables.resume(req, req.num_computed_tokens)
        req.status = Status.WAITING
        req.load = None
        req.load_ok = None
        req.whole_allocation_next = True
        self.cache_computed(req)

    def _preempt(self, req: Request) -> None:
        """Free a running request's blocks (or a waiting one's whose load landed) and
        queue it again at the front, to recompute from scratch."""
        if req in self.running:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.free_blocks(req)
        req.load = None
        req.load_ok = None
        req.num_computed_tokens = 0
        req.pending.clear()
        req.generation += 1
        req.status = Status.WAITING
        req.whole_allocation_next = True
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.insert(0, req)

    def free_blocks(self, req: Request) -> None:
        self.tables.release(req)

    def cache_computed(self, req: Request) -> None:
        """Register the request's full computed blocks in the prefix cache."""
        self.registration.register(req)
