"""The metrics recorder: every counter and histogram of one scheduler half.

Names and label names are those of :data:`kvoffload.core.observe.metrics.METRICS`. Who
records:

- the scheduler half counts its own events (lookups, loads, stores, deferrals,
  preemptions, anomalies, refused request parameters, resets, flushes, internal
  errors) and observes the transfer and deferral histograms, in its recorder;
- each directory and each lower tier counts through a :class:`CounterScope`: a
  recorder with the ``tier`` label fixed. A directory or tier starts on a private
  recorder (it works alone, in its own tests); the scheduler half moves it onto its
  own when it is built (:meth:`CounterScope.rebind`), so one recorder holds every
  series of one scheduler half.

Counters: ``counters[(name, labels)]``, ints, monotonic (never reset, not even by a
connector reset). A series exists once counted or declared (:meth:`declare`: at 0,
so a fixed series is exported before its first event). A series' first use is
checked against METRICS (a counter of that name, exactly those label names):
anything else raises :class:`ContractViolation`, so nothing undeclared is recorded.
``read_metrics`` copies the counters; tests, the simulator's report and the
harnesses read one series with :meth:`value` or one label's breakdown with
:meth:`breakdown`, from the recorder itself: no stats object mirrors a counter
(``SchedulerStats`` keeps only job counts that are no metric; ``AnomalyLog.counts``
is a view of ``anomalies_total``).

Histograms: a :class:`Histogram` keeps cumulative bucket counts (for scrapes of the
totals); the recorder also queues raw observations, drained by
:meth:`take_observations` (for vLLM's stats path, which ships per-step deltas
between processes). The queue is bounded: past ``MAX_PENDING`` observations per
series the oldest are dropped and counted in ``dropped``; totals are never affected.

Pure Python, no locking (the owner serializes access).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvoffload.core.errors import ContractViolation
from kvoffload.core.observe.metrics import BY_NAME, Labels, Series, labels

MAX_PENDING = 4096


class Histogram:
    """Cumulative bucket counts: ``counts[i]`` observations <= ``bounds[i]``
    (non-cumulative per bucket; the last bucket is +Inf), their ``total`` and ``count``."""

    __slots__ = ("bounds", "count", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def cumulative(self) -> list[int]:
        """Counts per upper bound, cumulative (Prometheus' ``le`` buckets), +Inf last."""
        out, running = [], 0
        for c in self.counts:
            running += c
            out.append(running)
        return out


def _check_counter(series: Series) -> None:
    name, pairs = series
    metric = BY_NAME.get(name)
    if metric is None or metric.kind != "counter":
        raise ContractViolation(f"{name!r} is not a counter of METRICS")
    if sorted(k for k, _ in pairs) != sorted(metric.labels):
        raise ContractViolation(f"{name}: labels {pairs!r}, declared {metric.labels!r}")


@dataclass
class MetricsRecorder:
    """Counters and histograms, keyed by (metric name, labels)."""

    counters: dict[Series, int] = field(default_factory=dict)
    histograms: dict[Series, Histogram] = field(default_factory=dict)
    pending: dict[Series, deque[float]] = field(default_factory=dict)
    dropped: int = 0

    # ------------------------------------------------------------ counters

    def count(self, name: str, n: int = 1, /, **pairs: str) -> None:
        """Add ``n`` (>= 0) to the counter series ``name{pairs}``."""
        self.add((name, tuple(sorted(pairs.items())) if pairs else ()), n)  # labels(), inlined

    def add(self, series: Series, n: int = 1) -> None:
        """Add ``n`` (>= 0) to ``series``, a (name, labels) pair as :func:`labels` builds."""
        value = self.counters.get(series)
        if value is None:
            _check_counter(series)
            value = 0
        self.counters[series] = value + n

    def declare(self, name: str, **pairs: str) -> None:
        """Make the series exist (at 0 unless already counted)."""
        key = (name, labels(**pairs))
        if key not in self.counters:
            _check_counter(key)
            self.counters[key] = 0

    def declare_all(self, series: Iterable[Series]) -> None:
        for name, pairs in series:
            self.declare(name, **dict(pairs))

    def value(self, name: str, **pairs: str) -> int:
        """One counter series (0 when never counted)."""
        return self.counters.get((name, labels(**pairs)), 0)

    def breakdown(self, name: str, label: str, **pairs: str) -> dict[str, int]:
        """The ``name`` series whose labels include ``pairs``, by their ``label``
        value, in the order they were first recorded."""
        out: dict[str, int] = {}
        for (series_name, series), n in self.counters.items():
            if series_name == name:
                values = dict(series)
                if all(values.get(k) == v for k, v in pairs.items()):
                    out[values[label]] = out.get(values[label], 0) + n
        return out

    def absorb(self, counters: Iterable[tuple[Series, int]]) -> None:
        """Add the given series (declared ones too, at 0)."""
        for key, n in counters:
            if key not in self.counters:
                _check_counter(key)
            self.counters[key] = self.counters.get(key, 0) + n

    # ------------------------------------------------------------ histograms

    def observe(self, name: str, series: Labels, value: float) -> None:
        key = (name, series)
        histogram = self.histograms.get(key)
        if histogram is None:
            histogram = self.histograms[key] = Histogram(BY_NAME[name].buckets)
            self.pending[key] = deque(maxlen=MAX_PENDING)
        histogram.observe(value)
        queue = self.pending[key]
        if len(queue) == MAX_PENDING:
            self.dropped += 1
        queue.append(value)

    def observe_transfer(self, direction: str, tier: str, nbytes: int, seconds: float) -> None:
        series = (("direction", direction), ("tier", tier))  # labels(), inlined: sorted names
        self.observe("transfer_bytes", series, float(nbytes))
        self.observe("transfer_seconds", series, seconds)

    def observe_deferral(self, reason: str, seconds: float) -> None:
        self.observe("deferral_seconds", labels(reason=reason), seconds)

    def take_observations(self) -> dict[Series, list[float]]:
        """Raw observations since the previous call (bounded, see module docstring)."""
        taken = {key: list(queue) for key, queue in self.pending.items() if queue}
        for key in taken:
            self.pending[key].clear()
        return taken


class CounterScope:
    """The counters of one directory or lower tier: a recorder with ``fixed`` labels
    (the tier name) added to every series it counts, declares or reads."""

    def __init__(self, recorder: MetricsRecorder, **fixed: str) -> None:
        self.recorder = recorder
        self.fixed = fixed
        self._series: dict[str, Series] = {}  # name -> its series with only the fixed labels

    @classmethod
    def private(cls, **fixed: str) -> CounterScope:
        """A scope on a recorder of its own (a directory or tier used alone)."""
        return cls(MetricsRecorder(), **fixed)

    def count(self, name: str, n: int = 1, /, **pairs: str) -> None:
        if pairs:
            self.recorder.count(name, n, **self.fixed, **pairs)
            return
        series = self._series.get(name)  # the common case, on every store and eviction
        if series is None:
            series = self._series[name] = (name, labels(**self.fixed))
        self.recorder.add(series, n)

    def declare(self, *names: str, **pairs: str) -> None:
        for name in names:
            self.recorder.declare(name, **self.fixed, **pairs)

    def value(self, name: str, **pairs: str) -> int:
        return self.recorder.value(name, **self.fixed, **pairs)

    def breakdown(self, name: str, label: str) -> dict[str, int]:
        return self.recorder.breakdown(name, label, **self.fixed)

    def rebind(self, recorder: MetricsRecorder) -> None:
        """Count into ``recorder`` from now on, carrying over this scope's series
        (those with its fixed labels) from the recorder it used so far. No-op when
        it already counts there."""
        if recorder is self.recorder:
            return
        mine = labels(**self.fixed)
        held = self.recorder.counters.items()
        recorder.absorb((k, n) for k, n in held if set(mine) <= set(k[1]))
        self.recorder = recorder
