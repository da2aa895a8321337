"""One request's state in the scheduler half: an explicit phase machine.

::

               lookup hit + on_allocated                load reported
   WAITING ───────────────────────────────▶ LOADING ──────────────────▶ RUNNING
   │ ▲ promotion planned / reported: WAITING <-> PROMOTING (lower tier -> host)
     │ ▲  scheduled without a load (miss)                                  │ │
     │ └───────────────────────────────────────────────────────────────────┼─┘
     │          ▲ stores drained           preempted, stores in flight     │
     │          └────────── PREEMPTED_DRAINING ◀───────────────────────────┤
     │                        │  deferral bound reached: admitted, no hit  │
     │                        └──────────────────────▶ RUNNING             │
     │   preempted with nothing in flight: RUNNING ──▶ WAITING             │
     │                                                  finished / aborted ▼
     │                                                                 FINISHING
     │                       its final store planned, jobs in flight       │
     │                                    ┌────────────────────────────────┤
     ▼                                    ▼            nothing in flight   │
   finished / aborted ──▶ FINISHED_DRAINING ──last job reported──▶ DONE ◀──┘
   (not running)      ──────────── nothing in flight ─────────────▶ DONE

FINISHING: the request finished (or was aborted) while running; the engine freed
its blocks (the stores reading them are fenced) and its final store goes into the
next plan, which moves it on (:meth:`StepBuilder.build`). Until then nothing else
moves it: its jobs completing do not drop it, a lookup or an allocation of its id
is an anomaly (served without offloading), it is never scheduled or preempted.

A request's jobs in flight are not part of its state: the job tracker owns them
and answers what a request has in flight (:meth:`JobTracker.jobs_of` and the
methods beside it). Invariant: those are one load or any number of stores (and at
most one promotion), never a load and stores; a request with any job in flight is
never looked up in the directory (lookup answers retry later), which is what makes a
preempted request's re-admission safe under asynchronous scheduling. A state is
dropped only once it has no job in flight, so a later request of the same id never
finds the jobs of an earlier one.

Owned and mutated only by the scheduler half; who writes what:

- ``phase``: :meth:`RequestState.move` only, called by the façade (finish), the
  allocations (admission), the step builder (scheduled, preempted, final store),
  the tier moves (promotion planned), the completions and the request table (DONE);
- ``deferred``: the :class:`DeferralClock` only (a frozen :class:`Deferred`);
- ``promotion``: wished by the load planner, taken by the tier moves, dropped by
  :meth:`admit` and :meth:`rekey`; ``no_promotion``: set by the load planner, the
  tier moves and the completions, cleared by :meth:`admit`;
- ``stored_chunks``: advanced by the store planner, reset by :meth:`admit`;
- ``blocks`` (one table per KV cache group): cleared at lookup and preemption, set
  by :meth:`admit` and the step builder; ``computed_tokens`` and
  ``scheduled_from``: the step builder (``computed_tokens`` clamped at finish);
- ``lookup_hit`` and ``lookup_tier`` (the lower tier the offered hit reads, for a
  tier load): written by lookup, read by the allocation; ``load_failed``: the
  load planner and the completions; ``stale_kv``: :meth:`rekey` sets it,
  :meth:`admit` clears it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvoffload.core.errors import IllegalTransition
from kvoffload.core.keys import ChunkKey, KeyChain, Namespace
from kvoffload.core.request_controls import DEFAULT, RequestControls
from kvoffload.core.scheduler.block_tables import BlockTables, GroupBlocks
from kvoffload.core.scheduler_types import Deferral, EngineRequest


class Phase(enum.Enum):
    WAITING = "waiting"  # not running, nothing in flight: lookup consults the directory
    LOADING = "loading"  # one load in flight; the engine waits for it
    PROMOTING = "promoting"  # waiting: its next chunks are coming up from a lower tier
    RUNNING = "running"  # admitted; store jobs may be in flight
    PREEMPTED_DRAINING = "preempted_draining"  # preempted, stores in flight: retry later
    FINISHING = "finishing"  # finished while running: its final store not yet planned
    FINISHED_DRAINING = "finished_draining"  # finished or aborted, jobs in flight
    DONE = "done"  # terminal; the state is dropped

    # Members are singletons: hash them by identity (the transition check hashes two
    # per move, for every request, every step; enum's default hashes the name).
    __hash__ = object.__hash__


_P = Phase
TRANSITIONS: dict[tuple[Phase, Phase], str] = {
    (_P.WAITING, _P.LOADING): "on_allocated with a hit: one load job",
    (_P.WAITING, _P.RUNNING): "admitted without a load",
    (_P.LOADING, _P.RUNNING): "the load was reported (failed blocks are recomputed)",
    (_P.RUNNING, _P.PREEMPTED_DRAINING): "preempted while stores are in flight",
    (_P.RUNNING, _P.WAITING): "preempted with nothing in flight",
    (_P.PREEMPTED_DRAINING, _P.WAITING): "its stores were reported",
    (_P.PREEMPTED_DRAINING, _P.RUNNING): "deferral bound reached: admitted without a hit",
    (_P.WAITING, _P.FINISHED_DRAINING): "aborted before running, stores in flight",
    (_P.LOADING, _P.FINISHED_DRAINING): "aborted while loading",
    (_P.PREEMPTED_DRAINING, _P.FINISHED_DRAINING): "aborted while draining",
    (_P.WAITING, _P.PROMOTING): "a promotion of its next chunks was planned",
    (_P.PROMOTING, _P.WAITING): "the promotion was reported",
    (_P.PROMOTING, _P.RUNNING): "deferral bound reached while promoting: admitted, no hit",
    (_P.PROMOTING, _P.FINISHED_DRAINING): "aborted while promoting",
    (_P.RUNNING, _P.FINISHING): "finished or aborted while running: final store next plan",
    (_P.FINISHING, _P.FINISHED_DRAINING): "its final store was planned, jobs in flight",
    (_P.FINISHING, _P.DONE): "its final store was planned, nothing in flight",
    (_P.WAITING, _P.DONE): "finished or aborted, nothing in flight",
    (_P.FINISHED_DRAINING, _P.DONE): "its last job was reported",
}


@dataclass(frozen=True)
class Deferred:
    """A request told *retry later*: since busy step ``since_step`` and time
    ``since_s`` (its first deferral), last for ``reason`` (written only by the
    :class:`~kvoffload.core.scheduler.deferral.DeferralClock`)."""

    since_step: int
    since_s: float
    reason: Deferral


@dataclass(frozen=True)
class PromotionWish:
    """A lookup's wish: promote ``keys`` (the run after the readable host prefix) from
    lower tier ``tier`` into host memory in the next plan. ``groups``: the KV cache
    group of each key (the planner's entries), or none (one group: all 0)."""

    tier: str
    keys: tuple[ChunkKey, ...]
    groups: tuple[int, ...] = ()


class RequestState:
    """Everything the scheduler half knows about one request.

    ``blocks`` mirrors the engine's current allocation, one table per KV cache
    group (cleared at preemption and at every lookup). ``stored_chunks`` is the
    store cursor: chunks before it were offered for storing in this admission.
    ``computed_tokens`` counts tokens whose KV exists once the last scheduled step
    ran; ``scheduled_from`` the tokens the engine counted computed when it last
    scheduled the request (a window group's blocks below its window for that count
    may have been freed).
    """

    __slots__ = (
        "blocks",
        "computed_tokens",
        "controls",
        "deferred",
        "keys",
        "load_failed",
        "lookup_hit",
        "lookup_tier",
        "no_promotion",
        "phase",
        "promotion",
        "request",
        "request_id",
        "scheduled_from",
        "stale_kv",
        "stored_chunks",
    )

    def __init__(
        self,
        request: EngineRequest,
        namespace: Namespace,
        hashes_per_chunk: int,
        epoch: bytes = b"",
        controls: RequestControls = DEFAULT,
        *,
        groups: int = 1,
        extra: bytes = b"",
    ):
        self.request = request
        self.request_id: str = request.request_id  # the same for every request object it is given
        self.controls = controls  # what the request lets kvoffload do (request_controls.py)
        self.phase = Phase.WAITING
        self.keys = KeyChain(namespace, hashes_per_chunk, epoch, extra)
        self.blocks = BlockTables(groups)
        self.stored_chunks = 0
        self.computed_tokens = 0
        self.scheduled_from = 0
        self.lookup_hit: tuple[int, int] | None = None  # (local tokens, external tokens)
        self.lookup_tier: str | None = None  # the lower tier the offered hit reads, if any
        self.deferred: Deferred | None = None  # written only by the DeferralClock
        self.load_failed = False  # a load of this request failed: it recomputes from now on
        self.promotion: PromotionWish | None = None  # wished by lookup, taken by the plan
        self.no_promotion = False  # a promotion could not be planned: none until admitted
        self.stale_kv = False  # its KV's weights are not the current keys': never stored

    @property
    def finished(self) -> bool:
        """Finished or aborted, still tracked: FINISHING or FINISHED_DRAINING."""
        return self.phase in (Phase.FINISHING, Phase.FINISHED_DRAINING)

    def move(self, target: Phase) -> None:
        """Change phase; raise :class:`IllegalTransition` if the table forbids it."""
        if target is self.phase:
            return
        if (self.phase, target) not in TRANSITIONS:
            raise IllegalTransition(
                f"request {self.request_id!r}: {self.phase.name} -> {target.name} is not allowed"
            )
        self.phase = target

    def rekey(self, namespace: Namespace, epoch: bytes) -> None:
        """Key epoch ``epoch`` began (a connector reset, or the weights changed or
        were first learned, decision 0019): derive the keys anew (lazily, from the
        block hashes; the request's own ``extra`` kept) and forget a wished promotion
        (it names old keys). The KV this request holds in the engine, and any it
        computes from it, was computed before the new epoch: it is never stored
        (``stale_kv``) until the request is admitted again (preempted and recomputed)."""
        self.keys = KeyChain(namespace, self.keys.blocks_per_chunk, epoch, self.keys.extra)
        self.promotion = None
        self.stale_kv = True

    def admit(self, blocks: GroupBlocks, *, weights_known: bool = True) -> None:
        """The engine admitted the request (an allocation after a lookup) with
        ``blocks``, its whole allocation (per KV cache group): a fresh store cursor,
        no promotion wished or refused, its KV computed (or loaded) afresh from here,
        stored unless the weights it is computed with are not known
        (``weights_known`` False: never stored, decision 0019).
        The caller ends the deferral (:meth:`DeferralClock.end`) and moves the phase (RUNNING or
        LOADING)."""
        self.stored_chunks = 0
        self.promotion = None
        self.no_promotion = False
        self.stale_kv = not weights_known
        self.blocks.replace(blocks)
