"""A Prometheus endpoint for kvoffload's metrics on a loopback port.

For engines whose own metrics path does not carry kvoffload's (the offline ``LLM``
class, the reference engine, tests) and for operators who want kvoffload's series
apart from the engine's: ``MetricsEndpoint(read, port)`` serves
``http://127.0.0.1:<port>/metrics`` from a private registry. Every scrape calls
``read()`` for a fresh :class:`~kvoffload.core.observe.metrics_view.MetricsReading` (the
caller makes it consistent, e.g. under its lock), so the numbers are exactly the
scheduler half's at that moment. Binding fails at start with a
:class:`~kvoffload.core.errors.ConfigError` naming ``metrics_port``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvoffload.core.errors import ConfigError
from kvoffload.core.observe.metrics import METRICS, Labels
from kvoffload.core.observe.metrics_view import MetricsReading


class ReadingCollector(Collector):
    """Every series of :data:`METRICS` from one reading per scrape."""

    def __init__(self, read: Callable[[], MetricsReading]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        reading = self._read()
        for m in METRICS:
            names = list(m.labels)
            if m.kind == "counter":
                family: Metric = CounterMetricFamily(
                    m.full_name.removesuffix("_total"), m.help, labels=names
                )
                source = reading.counters
            elif m.kind == "gauge":
                family = GaugeMetricFamily(m.full_name, m.help, labels=names)
                source = reading.gauges
            else:
                histogram = HistogramMetricFamily(m.full_name, m.help, labels=names)
                for (name, series), h in sorted(reading.histograms.items()):
                    if name == m.name:
                        bounds = [*(str(b) for b in h.bounds), "+Inf"]
                        buckets = list(zip(bounds, (float(c) for c in h.cumulative()), strict=True))
                        histogram.add_metric(_values(series, names), buckets, h.total)
                yield histogram
                continue
            for (name, series), value in sorted(source.items()):
                if name == m.name:
                    family.add_metric(_values(series, names), value)  # type: ignore[attr-defined]
            yield family


def _values(series: Labels, names: list[str]) -> list[str]:
    """The label values of ``series`` (sorted by label name) in the order of ``names``
    (the metric's declared order: ``integrity_errors_total`` is ``tier, reason``)."""
    values = dict(series)
    return [values[n] for n in names]


class MetricsEndpoint:
    """An HTTP server thread on ``host:port`` (loopback by default); ``close`` stops it."""

    def __init__(
        self, read: Callable[[], MetricsReading], port: int, host: str = "127.0.0.1"
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(ReadingCollector(read))
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise ConfigError(
                "metrics_port", f"cannot listen on {host}:{port}: {exc.strerror or exc}"
            ) from None
        self.port = int(self._server.server_address[1])

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
