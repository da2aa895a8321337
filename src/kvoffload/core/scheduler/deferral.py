"""The deferral clock: how long a request has been told *retry later*, and when
that must stop (decision 0002).

Owns the count of busy engine steps (steps that scheduled work; idle steps do not
count), the time source and the two bounds (``max_deferral_steps``,
``max_deferral_seconds``). A request's deferral starts at its first *retry later*
and ends when it is admitted; the wait is observed in the deferral histogram by the
last reason it was deferred for. Mutates only the deferral fields of the request
states it is given, its own counters, and ``stats.deferrals``.
"""

from __future__ import annotations

from collections.abc import Callable

from kvoffload.core.metrics import MetricsRecorder
from kvoffload.core.scheduler.request_state import RequestState
from kvoffload.core.scheduler_types import Deferral, SchedulerConfig, SchedulerStats


class DeferralClock:
    def __init__(
        self,
        config: SchedulerConfig,
        stats: SchedulerStats,
        metrics: MetricsRecorder,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.stats = stats
        self.metrics = metrics
        self.clock = clock  # harnesses substitute logical time
        self.busy_steps = 0

    def tick(self, busy: bool) -> None:
        """One engine step passed; ``busy``: it scheduled work."""
        self.busy_steps += busy

    def defer(self, state: RequestState, reason: Deferral) -> None:
        if state.deferred_since_step is None:
            state.deferred_since_step = self.busy_steps
            state.deferred_since_s = self.clock()
        state.deferral_reason = reason
        self.stats.deferrals[reason] = self.stats.deferrals.get(reason, 0) + 1

    def expired(self, state: RequestState) -> bool:
        """The request has waited as long as either bound allows."""
        if state.deferred_since_step is None or state.deferred_since_s is None:
            return False
        return (
            self.busy_steps - state.deferred_since_step >= self.config.max_deferral_steps
            or self.clock() - state.deferred_since_s >= self.config.max_deferral_seconds
        )

    def end(self, state: RequestState) -> None:
        """The request is admitted: observe how long it was deferred, if it was."""
        if state.deferred_since_s is not None and state.deferral_reason is not None:
            waited = self.clock() - state.deferred_since_s
            self.metrics.observe_deferral(state.deferral_reason.value, waited)
        state.clear_deferral()
