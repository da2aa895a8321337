"""kvoffload's metrics on vLLM's connector stats path.

Every engine step vLLM asks the scheduler-side connector for stats
(``get_kv_connector_stats``), ships them to the front-end process as a dict, rebuilds
them with the connector class' ``build_kv_connector_stats`` and hands them to
``build_prom_metrics``' object, which exports them on vLLM's own ``/metrics``. The
dict is a *delta* since the previous call:

``{"c": {series: increment}, "h": {series: [observations]}, "g": {series: value}}``

where ``series`` is ``json.dumps([name, [[label, value], ...]])`` over the names of
:data:`kvoffload.core.observe.metrics.METRICS`. Gauges (they scan the pin counts) are read
when a counter moved and at least once a second, and sent when they changed, so the
step that finished the last transfer leaves vLLM's ``/metrics`` equal to kvoffload's
own endpoint while the engine idles. :class:`DeltaSource` computes the deltas from the scheduler
half; :class:`KVOffloadStats` merges and summarizes them; :class:`KVOffloadPromMetrics`
turns them into Prometheus series labelled like vLLM's (model name, engine) plus
kvoffload's own labels.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from typing import Any

from prometheus_client import REGISTRY

from kvoffload.adapters.vllm.compat import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    VllmConfig,
)
from kvoffload.core.observe.metrics import BY_NAME, METRICS, Labels, Series
from kvoffload.core.observe.metrics_view import MetricsReading

GAUGE_PERIOD_S = 1.0


def series_key(series: Series) -> str:
    name, labels = series
    return json.dumps([name, [list(pair) for pair in labels]])


def parse_series(key: str) -> tuple[str, Labels]:
    name, pairs = json.loads(key)
    return str(name), tuple((str(k), str(v)) for k, v in pairs)


class DeltaSource:
    """Turns successive readings of the scheduler half into deltas. ``read`` must
    return a consistent reading (the caller's lock) and ``take_observations`` the
    histogram observations since the previous call."""

    def __init__(
        self,
        read: Callable[[bool], MetricsReading],
        take_observations: Callable[[], dict[Series, list[float]]],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._read = read
        self._take = take_observations
        self._clock = clock
        self._last: dict[Series, float] = {}
        self._sent_gauges: dict[Series, float] = {}
        self._last_gauges = -GAUGE_PERIOD_S

    def delta(self) -> dict[str, Any]:
        """Counters that moved since the previous call, histogram observations, and
        the gauges that changed. Gauges are read when a counter moved (so the last
        busy step leaves ``/metrics`` exact while the engine then idles) and at
        least once every ``GAUGE_PERIOD_S``."""
        now = self._clock()
        reading = self._read(False)
        counters: dict[str, float] = {}
        for series, value in reading.counters.items():
            before = self._last.get(series, 0.0)
            if value != before:
                counters[series_key(series)] = value - before
                self._last[series] = value
        data: dict[str, Any] = {}
        if counters:
            data["c"] = counters
        observations = {series_key(k): v for k, v in self._take().items()}
        if observations:
            data["h"] = observations
        if counters or observations or now - self._last_gauges >= GAUGE_PERIOD_S:
            self._last_gauges = now
            gauges: dict[str, float] = {}
            for series, value in self._read(True).gauges.items():
                if self._sent_gauges.get(series) != value:
                    gauges[series_key(series)] = value
                    self._sent_gauges[series] = value
            if gauges:
                data["g"] = gauges
        return data


class KVOffloadStats(KVConnectorStats):
    """A delta (see the module docstring); ``aggregate`` adds another one."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVOffloadStats:
        c = dict(self.data.get("c", {}))
        for key, value in other.data.get("c", {}).items():
            c[key] = c.get(key, 0.0) + value
        h = {key: list(values) for key, values in self.data.get("h", {}).items()}
        for key, values in other.data.get("h", {}).items():
            h.setdefault(key, []).extend(values)
        g = {**self.data.get("g", {}), **other.data.get("g", {})}
        merged = {name: part for name, part in (("c", c), ("h", h), ("g", g)) if part}
        return KVOffloadStats(data=merged)

    def reduce(self) -> dict[str, int | float]:
        """The few numbers vLLM's periodic log line shows."""
        totals: dict[str, float] = {}
        for key, value in self.data.get("c", {}).items():
            name, labels = parse_series(key)
            if name == "hit_tokens_total":
                label = f"hit_tokens_{dict(labels)['tier']}"
            elif name == "transferred_chunks_total":
                label = f"{dict(labels)['direction']}_chunks"
            elif name in ("failed_chunks_total", "deferral_timeouts_total"):
                label = name.removesuffix("_total")
            else:
                continue
            totals[label] = totals.get(label, 0.0) + value
        return {k: int(v) for k, v in sorted(totals.items())}

    def is_empty(self) -> bool:
        return not (self.data.get("c") or self.data.get("h") or self.data.get("g"))


_REGISTERED: list[Any] = []  # our collectors in the default registry (see below)


class KVOffloadPromMetrics(KVConnectorPromMetrics):
    """kvoffload's series on vLLM's Prometheus registry, one child per engine."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM unregisters its own (``vllm:``) collectors when it builds a new stat
        # logger; do the same for ours, or a second engine in one process would fail
        # to register them.
        while _REGISTERED:
            collector = _REGISTERED.pop()
            with contextlib.suppress(KeyError):
                REGISTRY.unregister(collector)
        self._metrics: dict[str, Any] = {}
        counter: Any = self._counter_cls
        gauge: Any = self._gauge_cls
        histogram: Any = self._histogram_cls
        for m in METRICS:
            names = [*labelnames, *m.labels]
            if m.kind == "counter":
                metric = counter(
                    name=m.full_name.removesuffix("_total"), documentation=m.help, labelnames=names
                )
            elif m.kind == "gauge":
                metric = gauge(
                    name=m.full_name,
                    documentation=m.help,
                    labelnames=names,
                    multiprocess_mode="mostrecent",
                )
            else:
                metric = histogram(
                    name=m.full_name,
                    documentation=m.help,
                    labelnames=names,
                    buckets=list(m.buckets),
                )
            self._metrics[m.name] = metric
            _REGISTERED.append(metric)

    def _child(self, key: str, engine_idx: int) -> Any:
        name, labels = parse_series(key)
        metric = self._metrics.get(name)
        if metric is None:
            return None
        engine_values = [str(v) for v in self.per_engine_labelvalues.get(engine_idx, [])]
        values = dict(labels)  # sorted by name; the metric declares its own order
        return metric.labels(*engine_values, *(values[n] for n in BY_NAME[name].labels))

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.get("c", {}).items():
            child = self._child(key, engine_idx)
            if child is not None and value > 0:
                child.inc(value)
        for key, values in transfer_stats_data.get("h", {}).items():
            child = self._child(key, engine_idx)
            if child is not None:
                for value in values:
                    child.observe(value)
        for key, value in transfer_stats_data.get("g", {}).items():
            child = self._child(key, engine_idx)
            if child is not None:
                child.set(value)


__all__ = ["DeltaSource", "KVOffloadPromMetrics", "KVOffloadStats"]
