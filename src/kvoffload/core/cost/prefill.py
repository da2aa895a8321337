"""The engine's prefill speed, learned from step timings.

The scheduler half is told, at each plan, which tokens the engine scheduled; they are
computed before the next plan. :class:`PrefillMeter` turns (tokens, seconds between the
two plans) into tokens per second: decayed sums of both (each interval weighs
:data:`DECAY` of the next), so a burst of decode steps lowers the rate (recomputing then
looks dearer, which leans towards loading: the safe side). Intervals that computed
nothing, went backwards or last longer than :data:`MAX_INTERVAL_S` (an idle engine) are
skipped. Until an interval is measured the rate is the seed (``prefill_tokens_per_s``).

The clock is the scheduler half's (wall time in an engine, logical time in the
harnesses and the simulator), so the rate is deterministic wherever the clock is.
"""

from __future__ import annotations

import math

DECAY = 0.95
MAX_INTERVAL_S = 10.0


class PrefillMeter:
    __slots__ = ("_last_at", "_pending", "_seconds", "_tokens", "seed")

    def __init__(self, seed_tokens_per_s: float) -> None:
        self.seed = seed_tokens_per_s
        self._tokens = 0.0
        self._seconds = 0.0
        self._last_at: float | None = None
        self._pending = 0  # tokens scheduled at the last plan

    def step(self, now: float, scheduled_tokens: int) -> None:
        """A plan at ``now`` scheduled ``scheduled_tokens``: the interval since the
        previous plan computed what that one scheduled."""
        last, self._last_at = self._last_at, now
        pending, self._pending = self._pending, scheduled_tokens
        if last is None or pending < 1 or not math.isfinite(now):
            return
        elapsed = now - last
        if not 0 < elapsed <= MAX_INTERVAL_S:
            return
        self._tokens = self._tokens * DECAY + pending
        self._seconds = self._seconds * DECAY + elapsed

    @property
    def measured(self) -> bool:
        return self._seconds > 0

    def tokens_per_s(self) -> float:
        """The learned rate, or the seed while unmeasured."""
        return self._tokens / self._seconds if self._seconds > 0 else self.seed
