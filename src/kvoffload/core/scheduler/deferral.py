"""The deferral clock: how long a request has been told *retry later*, and when
that must stop (decision 0002).

Owns the count of busy engine steps (steps that scheduled work; idle steps do not
count), the time source and the two bounds (``max_deferral_steps``,
``max_deferral_seconds``). A request's deferral starts at its first *retry later*
and ends when it is admitted; the wait is observed in the deferral histogram by the
last reason it was deferred for. A request's deferral is one frozen
:class:`Deferred` value in ``state.deferred``; the clock is its only writer (a new
reason is a new value with the same start). Mutates only ``state.deferred`` of the
request states it is given, its own counters, and ``deferrals_total`` in the
recorder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from kvoffload.core.observe.recorder import MetricsRecorder
from kvoffload.core.scheduler.request_state import Deferred, RequestState
from kvoffload.core.scheduler_types import Deferral, SchedulerConfig


class DeferralClock:
    def __init__(
        self,
        config: SchedulerConfig,
        metrics: MetricsRecorder,
        clock: Callable[[], float],
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.clock = clock  # harnesses substitute logical time
        self.busy_steps = 0
        self.idle_steps = 0  # consecutive engine steps that scheduled no request

    def tick(self, busy: bool) -> None:
        """One engine step passed; ``busy``: it scheduled work."""
        self.busy_steps += busy
        self.idle_steps = 0 if busy else self.idle_steps + 1

    def defer(self, state: RequestState, reason: Deferral) -> None:
        if state.deferred is None:
            state.deferred = Deferred(self.busy_steps, self.clock(), reason)
        else:
            state.deferred = replace(state.deferred, reason=reason)
        self.metrics.count("deferrals_total", reason=reason.value)

    def expired(self, state: RequestState) -> bool:
        """The request has waited as long as either bound allows."""
        deferred = state.deferred
        if deferred is None:
            return False
        return (
            self.busy_steps - deferred.since_step >= self.config.max_deferral_steps
            or self.clock() - deferred.since_s >= self.config.max_deferral_seconds
        )

    def waited_steps(self, state: RequestState) -> int:
        """Busy engine steps the request has been deferred for (0 when it is not)."""
        deferred = state.deferred
        return 0 if deferred is None else self.busy_steps - deferred.since_step

    def waited_s(self, state: RequestState) -> float:
        """How long the request has been deferred (0 when it is not)."""
        deferred = state.deferred
        return 0.0 if deferred is None else max(0.0, self.clock() - deferred.since_s)

    def end(self, state: RequestState) -> None:
        """The request is admitted: observe how long it was deferred, if it was."""
        deferred = state.deferred
        if deferred is not None:
            self.metrics.observe_deferral(deferred.reason.value, self.clock() - deferred.since_s)
        state.deferred = None
