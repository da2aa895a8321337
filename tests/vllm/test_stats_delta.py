"""The deltas kvoffload sends on vLLM's stats path leave vLLM's /metrics exact once
the engine idles: gauges follow the last counter change, not a timer."""

from __future__ import annotations

from typing import Any

from kvoffload.adapters.vllm.stats import DeltaSource, KVOffloadStats, series_key
from kvoffload.core.observe.metrics import Series
from kvoffload.core.observe.metrics_view import MetricsReading

STORED: Series = ("transferred_chunks_total", (("direction", "store"), ("tier", "host")))
USAGE: Series = ("usage_bytes", (("tier", "host"),))


class Engine:
    """A scheduler half reduced to one counter and one gauge."""

    def __init__(self) -> None:
        self.stored = 0
        self.usage = 0
        self.now = 0.0

    def read(self, with_gauges: bool) -> MetricsReading:
        reading = MetricsReading(counters={STORED: float(self.stored)})
        if with_gauges:
            reading.gauges[USAGE] = float(self.usage)
        return reading


def source(engine: Engine) -> DeltaSource:
    return DeltaSource(engine.read, dict, clock=lambda: engine.now)


def test_the_step_that_moves_a_counter_carries_the_gauges_it_changed() -> None:
    engine = Engine()
    deltas = source(engine)
    assert deltas.delta() == {"g": {series_key(USAGE): 0.0}}  # the first call reads the gauges
    for step in range(1, 6):  # five busy steps within one gauge period
        engine.now += 0.01
        engine.stored += 1
        engine.usage = step * 100
        data = deltas.delta()
        assert data["c"] == {series_key(STORED): 1.0}
        assert data["g"] == {series_key(USAGE): float(step * 100)}
    engine.now += 0.01
    assert deltas.delta() == {}  # idle, nothing changed: nothing sent


def test_a_gauge_only_delta_is_not_dropped_as_empty() -> None:
    engine = Engine()
    deltas = source(engine)
    deltas.delta()
    engine.usage = 4096  # e.g. an eviction counted elsewhere
    engine.now += 2.0  # the gauge period passed
    data = deltas.delta()
    assert data == {"g": {series_key(USAGE): 4096.0}}
    assert not KVOffloadStats(data=data).is_empty()  # vLLM drops empty stats


def test_unchanged_gauges_are_not_resent() -> None:
    engine = Engine()
    deltas = source(engine)
    deltas.delta()
    engine.now += 2.0
    assert deltas.delta() == {}


def test_label_values_follow_the_metric_s_declared_order_on_vllm_s_registry() -> None:
    """``integrity_errors_total`` declares ``tier, reason``; its series are keyed by
    labels sorted by name (``reason, tier``): each value lands under its own label."""
    from types import SimpleNamespace

    from prometheus_client import REGISTRY, Counter, Gauge, Histogram, generate_latest

    from kvoffload.adapters.vllm.stats import KVOffloadPromMetrics
    from kvoffload.core.observe.metrics import labels

    config: Any = SimpleNamespace(kv_transfer_config=None)
    types: dict[type, type] = {Counter: Counter, Gauge: Gauge, Histogram: Histogram}
    metrics = KVOffloadPromMetrics(config, types, ["model_name", "engine"], {0: ["m", "0"]})
    errors = ("integrity_errors_total", labels(tier="disk", reason="checksum"))
    metrics.observe({"c": {series_key(errors): 2.0}})
    text = generate_latest(REGISTRY).decode()
    line = (
        'kvoffload_integrity_errors_total{engine="0",model_name="m",reason="checksum",tier="disk"}'
    )
    assert f"{line} 2.0" in text
