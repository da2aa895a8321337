"""Load or recompute: the pure decision for one lane's part of a hit.

A hit is split by lane along the chain: the chunks host memory holds (the head, always
loaded: a host copy is memcpy-fast) and those one lower tier holds (the tail, on that
tier's lane). The tail is loaded when its expected ready time (the work queued on its
lane plus its own transfer) beats recomputing its tokens at the engine's prefill speed
(the threshold). Under a linear cost a part is worth loading whole or not at all, so
the decision is one verdict per part, never a cut inside it.

Hysteresis: each lane holds a :class:`Verdict`. A lane that loads turns to recompute
only when loading is slower than ``threshold * (1 + hysteresis)``; a lane that
recomputes turns back only when loading is faster than ``threshold * (1 - hysteresis)``;
in between it keeps its verdict. An unmeasured lower tier's lane (no estimate) loads: its
first load is the probe that measures it. While the probe is in flight its age is the
evidence: further parts load as long as the probe has been in flight for less than
recomputing them would take, and are recomputed once it has been in flight longer (a
fresh engine's concurrent hits all load from a fast tier; a slow tier's first minutes
never pile up a queue behind a transfer that is already slower than recomputing). A
load expected within :data:`NEGLIGIBLE_S` is always taken (a decision below timing
noise).
"""

from __future__ import annotations

import enum
from typing import NamedTuple

NEGLIGIBLE_S = 1e-4


class Verdict(enum.Enum):
    """A lane's standing decision (moves only as the module docstring says)."""

    LOAD = "load"
    RECOMPUTE = "recompute"


class Decline(enum.Enum):
    """Why a part of a hit was recomputed (the ``reason`` label of
    ``kvoffload_hits_declined_total``)."""

    TRANSFER = "transfer"  # its transfer alone is slower than recomputing it
    QUEUE = "queue"  # an idle lane would have loaded it: the work queued on it is why
    UNMEASURED = "unmeasured"  # the lane's first load, its probe, is in flight for too long
    UNANSWERED = "unanswered"  # the tier could not tell yet; its lane stands at recompute


class LaneDecision(NamedTuple):
    verdict: Verdict
    decline: Decline | None  # None: load


def decide_lane(
    previous: Verdict,
    *,
    load_s: float | None,
    idle_load_s: float | None,
    recompute_s: float,
    hysteresis: float,
    probe_age_s: float | None = None,
) -> LaneDecision:
    """The lane's new verdict for a part that takes ``load_s`` to be ready (queue
    included; ``idle_load_s`` without the queue; None: unmeasured, and then
    ``probe_age_s`` is how long the unmeasured lane's probe has been in flight, None
    when none is) against ``recompute_s`` to recompute. Pure."""
    threshold = recompute_s
    if load_s is None and probe_age_s is not None and probe_age_s > threshold:
        return LaneDecision(previous, Decline.UNMEASURED)
    if load_s is None or load_s <= NEGLIGIBLE_S:
        return LaneDecision(Verdict.LOAD, None)
    if previous is Verdict.LOAD:
        declines = load_s > threshold * (1 + hysteresis)
    else:
        declines = load_s >= threshold * (1 - hysteresis)
    if not declines:
        return LaneDecision(Verdict.LOAD, None)
    idle_fast = idle_load_s is not None and idle_load_s <= threshold
    return LaneDecision(Verdict.RECOMPUTE, Decline.QUEUE if idle_fast else Decline.TRANSFER)
