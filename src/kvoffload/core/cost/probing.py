"""A declined lane's re-measurement: its probe, as an explicit state machine.

A lower tier's lane whose verdict is RECOMPUTE gets no loads, so nothing would ever
tell its model that the tier turned fast again. Now and then the first chunk of a part
of a hit on it is loaded anyway, as the lane's *probe* (the rest of the part is
recomputed); its timing starts the lane's window again
(:meth:`~kvoffload.core.cost.lanes.LaneModel.restart`), and the next decision on the
lane moves its verdict back to LOAD if loading now beats recomputing (hysteresis
included). :class:`LaneProbe` is one lane's probe::

                declined                a lookup of a part, due       its load planned
      IDLE ─────────────▶ WAITING ─────────────────────────▶ OFFERED ─────────────────▶ IN_FLIGHT
       ▲                   ▲  ▲  not planned by the second plan since │                      │
       │                   │  └───────────────────────────────────────┘                      │
       │                   └──────── its first result, or its job gone (the backoff doubles) ─┘
       └──── the lane's verdict turned LOAD, from any state (backoff and credit start again)

A probe is *due* when both hold:

- **time**: :data:`FIRST_BACKOFF_S` has passed since the decline, and after each probe
  a backoff that doubles from one probe to the next, up to :data:`MAX_BACKOFF_S`;
- **credit**: the parts declined on the lane since the last probe would take at least
  ``cost / PROBE_SHARE`` to recompute (as the decision counts them), ``cost`` being
  what the last probe cost its request: the longer of its timing and the time from its
  plan to its first result (queueing behind the tier's other traffic included; a read
  that timed out counts for its deadline); before the first probe, the lane model's
  estimate of one chunk's read behind its queue.

And at most one probe per lane is offered or in flight; it reads :data:`PROBE_CHUNKS`
chunk, the first of the part past the host prefix.

So a lane that stays slow costs, in probes, at most :data:`PROBE_SHARE` of the
recompute time it declined (past the first probe, whose cost is an estimate), one
chunk's read per backoff at most, and nothing while no hit comes its way; a lane that
turns fast is loaded from again at the first hit once the backoff has passed (at most
about as long after the turn as the lane had been declined, plus a second, and never
more than :data:`MAX_BACKOFF_S`) and the hits it declined since its last probe would
have taken ``cost / PROBE_SHARE`` to recompute: what declining a fast lane loses
before its probe is bounded by what a probe of a slow one costs.

Time is the caller's: ``now`` is the scheduler half's clock (wall time in an engine,
logical time in the harnesses and the simulator), plans are counted by the caller. Owned
and mutated by one :class:`~kvoffload.core.cost.model.CostModel`; a move the table does
not allow raises :class:`~kvoffload.core.errors.IllegalTransition` (a bug: every method
below moves only from the states it names, and otherwise does nothing).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Container

from kvoffload.core.errors import IllegalTransition

PROBE_CHUNKS = 1
"""Chunk positions past the host prefix a probe loads (the rest of its part is
recomputed)."""

FIRST_BACKOFF_S = 1.0
"""Seconds from a lane's decline to its first probe."""

MAX_BACKOFF_S = 64.0
"""The longest backoff between two probes of a lane that stays slow."""

PROBE_SHARE = 0.05
"""The most a lane's probes cost, as a share of the recompute time of the parts it
declined: a probe is due only once the parts declined since the last one would take
``cost / PROBE_SHARE`` to recompute (``cost``: what the last probe cost its request)."""


class ProbeState(enum.Enum):
    IDLE = "idle"  # the lane loads: nothing to re-measure
    WAITING = "waiting"  # declined: the next probe is due at ``due_at``
    OFFERED = "offered"  # a lookup offered the probe to ``request_id``, not yet planned
    IN_FLIGHT = "in_flight"  # the probe's job ``job_id`` is in flight


_S = ProbeState
TRANSITIONS: dict[tuple[ProbeState, ProbeState], str] = {
    (_S.IDLE, _S.WAITING): "the lane's verdict turned RECOMPUTE",
    (_S.WAITING, _S.OFFERED): "a lookup of a part on the lane, the probe due",
    (_S.OFFERED, _S.IN_FLIGHT): "the offered request's load (or promotion) was planned",
    (_S.OFFERED, _S.WAITING): "not planned by the second plan since the offer: lapsed",
    (_S.IN_FLIGHT, _S.WAITING): "its first result, or its job left the tracker without one",
    (_S.WAITING, _S.IDLE): "the lane's verdict turned LOAD",
    (_S.OFFERED, _S.IDLE): "the lane's verdict turned LOAD",
    (_S.IN_FLIGHT, _S.IDLE): "the lane's verdict turned LOAD",
}


class LaneProbe:
    """One lower tier's lane's probe (see the module docstring)."""

    __slots__ = (
        "backoff_s",
        "cost_s",
        "declined_s",
        "due_at",
        "job_id",
        "offered_plan",
        "planned_at",
        "request_id",
        "state",
    )

    def __init__(self) -> None:
        self.state = ProbeState.IDLE
        self.backoff_s = FIRST_BACKOFF_S
        self.due_at = math.inf  # not IDLE: the backoff's end
        self.declined_s = 0.0  # recompute seconds of the parts declined since the last probe
        self.cost_s = 0.0  # not IDLE: what the next probe is expected to cost its request
        self.request_id: str | None = None  # OFFERED: to whom
        self.offered_plan = 0  # OFFERED: the plan count at the offer
        self.job_id: int | None = None  # IN_FLIGHT: the probe's job
        self.planned_at = 0.0  # IN_FLIGHT: when it was planned

    def _move(self, target: ProbeState) -> None:
        if (self.state, target) not in TRANSITIONS:
            raise IllegalTransition(f"lane probe {self.state.name} -> {target.name} is not allowed")
        self.state = target

    def loads(self) -> None:
        """The lane's verdict is LOAD: nothing to re-measure; backoff and credit start
        again."""
        if self.state is not ProbeState.IDLE:
            self._move(ProbeState.IDLE)
        self.backoff_s = FIRST_BACKOFF_S
        self.due_at = math.inf
        self.declined_s = self.cost_s = 0.0
        self.request_id = self.job_id = None

    def declined(self, now: float, recompute_s: float, probe_cost_s: float) -> None:
        """A part that takes ``recompute_s`` to recompute was declined at ``now`` (the
        lane's verdict is RECOMPUTE): it adds to the credit. An IDLE lane now waits for
        its first probe, due :data:`FIRST_BACKOFF_S` from ``now`` and expected to cost
        ``probe_cost_s`` (the lane model's estimate)."""
        if self.state is ProbeState.IDLE:
            self._move(ProbeState.WAITING)
            self.due_at = now + self.backoff_s
            self.cost_s = _seconds(probe_cost_s)
        self.declined_s += _seconds(recompute_s)

    def due(self, now: float) -> bool:
        """Whether a lookup at ``now`` would be offered the probe: WAITING, the backoff
        over and the credit enough. No side effect."""
        return (
            self.state is ProbeState.WAITING
            and now >= self.due_at
            and self.declined_s * PROBE_SHARE >= self.cost_s
        )

    def offer(self, now: float, request_id: str, plan: int) -> bool:
        """Whether a declined part of ``request_id``'s hit is loaded as the probe: yes
        when the probe is due (it is then OFFERED to that request at plan count
        ``plan``), or already offered to that request (looked up again)."""
        if self.state is ProbeState.OFFERED:
            return self.request_id == request_id
        if not self.due(now):
            return False
        self._move(ProbeState.OFFERED)
        self.request_id, self.offered_plan = request_id, plan
        return True

    def planned(self, job_id: int, request_id: str | None, now: float) -> bool:
        """A job reading on the lane for ``request_id`` is planned at ``now``: it is the
        probe (now IN_FLIGHT; the credit is spent) when the probe was offered to that
        request."""
        if self.state is not ProbeState.OFFERED or request_id != self.request_id:
            return False
        self._move(ProbeState.IN_FLIGHT)
        self.job_id, self.request_id, self.planned_at = job_id, None, now
        self.declined_s = 0.0
        return True

    def result(self, job_id: int, now: float, seconds: float) -> bool:
        """A worker's result of job ``job_id`` at ``now``, timed ``seconds``: when it is
        the probe's first, the probe ends (see :meth:`_ended`) and True."""
        if self.state is not ProbeState.IN_FLIGHT or job_id != self.job_id:
            return False
        self._ended(now, max(_seconds(seconds), now - self.planned_at))
        return True

    def on_plan(self, plan: int, now: float, live: Container[int]) -> None:
        """Plan number ``plan`` at ``now``: an offer not planned by the second plan
        since it was made lapses (the probe is due again at once); a probe whose job
        is not among the ``live`` job ids any more (dropped without a result) ends."""
        if self.state is ProbeState.OFFERED and plan > self.offered_plan + 1:
            self._move(ProbeState.WAITING)
            self.request_id = None
        elif self.state is ProbeState.IN_FLIGHT and self.job_id not in live:
            self._ended(now, now - self.planned_at)

    def _ended(self, now: float, cost_s: float) -> None:
        """IN_FLIGHT -> WAITING: the probe cost its request ``cost_s``; the backoff
        doubles (up to :data:`MAX_BACKOFF_S`) and the next probe is due that long from
        ``now``, once the credit covers ``cost_s`` again."""
        self._move(ProbeState.WAITING)
        self.job_id = None
        self.backoff_s = min(MAX_BACKOFF_S, self.backoff_s * 2)
        self.due_at = now + self.backoff_s
        self.cost_s = _seconds(cost_s)


def _seconds(value: float) -> float:
    """``value`` if a finite duration, else 0 (nonsense teaches nothing)."""
    return value if math.isfinite(value) and value > 0 else 0.0
