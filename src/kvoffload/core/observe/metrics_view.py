"""One consistent reading of every kvoffload metric from a scheduler half.

``read_metrics`` copies the counter series and the histograms of the scheduler
half's recorder (:mod:`kvoffload.core.observe.recorder`: where its directories and lower
tiers count too, each series once, under the names and labels of
:data:`kvoffload.core.observe.metrics.METRICS`) and computes the gauges. It only reads; the
caller must hold whatever lock serializes access to the scheduler half. Cost:
O(series) plus one pass over the pin counts of each directory for the
``pinned_chunks`` gauge (``with_gauges=False`` skips gauges).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvoffload.core.cost import Verdict, tier_costs
from kvoffload.core.observe.metrics import Series, labels
from kvoffload.core.observe.recorder import Histogram
from kvoffload.core.tiering.lower import DirectoryTier

if TYPE_CHECKING:
    from kvoffload.core.scheduler import OffloadScheduler


@dataclass
class MetricsReading:
    counters: dict[Series, float] = field(default_factory=dict)
    gauges: dict[Series, float] = field(default_factory=dict)
    histograms: dict[Series, Histogram] = field(default_factory=dict)

    def value(self, name: str, **pairs: str) -> float:
        """A counter or gauge by name and labels (0 when never counted)."""
        key = (name, labels(**pairs))
        return self.counters.get(key, self.gauges.get(key, 0.0))


def read_metrics(
    scheduler: OffloadScheduler, chunk_bytes: int, *, with_gauges: bool = True
) -> MetricsReading:
    """``chunk_bytes``: one chunk's bytes, all workers together."""
    recorder = scheduler.metrics
    out = MetricsReading(
        counters={series: float(n) for series, n in recorder.counters.items()},
        histograms=dict(recorder.histograms),
    )
    if with_gauges:
        out.gauges = _gauges(scheduler, chunk_bytes)
    return out


def _gauges(scheduler: OffloadScheduler, chunk_bytes: int) -> dict[Series, float]:
    host = scheduler.directory
    g: dict[Series, float] = {("jobs_in_flight", ()): float(len(scheduler.jobs_in_flight()))}
    g[("usage_bytes", labels(tier="host"))] = float(len(host) * chunk_bytes)
    g[("capacity_bytes", labels(tier="host"))] = float(host.num_slots * chunk_bytes)
    g[("pinned_chunks", labels(tier="host"))] = float(host.pinned_count)
    g.update(_cost_gauges(scheduler))
    for tier in scheduler.tiers.tiers.values():
        g[("usage_bytes", labels(tier=tier.name))] = float(tier.held_count() * chunk_bytes)
        quarantined = scheduler.moves.quarantine.chunks(tier.name)
        g[("quarantined_chunks", labels(tier=tier.name))] = float(quarantined)
        if isinstance(tier, DirectoryTier):
            capacity = tier.directory.num_slots * chunk_bytes
            g[("capacity_bytes", labels(tier=tier.name))] = float(capacity)
            g[("pinned_chunks", labels(tier=tier.name))] = float(tier.directory.pinned_count)
    return g


def _cost_gauges(scheduler: OffloadScheduler) -> dict[Series, float]:
    """The cost model's lanes (those measured or decided on), prefill speed and each
    measured tier's load cost and hit weight (:mod:`kvoffload.core.cost.hit_weights`)."""
    cost, config = scheduler.cost, scheduler.config
    g: dict[Series, float] = {
        ("cost_prefill_tokens_per_second", ()): cost.prefill.tokens_per_s(),
    }
    for name, lane in sorted(cost.lanes.items()):  # every lane decided on is here
        tier = labels(tier=name)
        g[("cost_lane_queued_chunks", tier)] = float(cost.queued_chunks(name))
        g[("cost_lane_loads", tier)] = float(cost.verdicts.get(name) is not Verdict.RECOMPUTE)
        fitted = lane.fit()
        if fitted is not None:
            g[("cost_lane_latency_seconds", tier)] = fitted[0]
            g[("cost_lane_seconds_per_chunk", tier)] = fitted[1]
        bandwidth = lane.bytes_per_second()
        if bandwidth is not None:
            g[("cost_lane_bytes_per_second", tier)] = bandwidth
    for measured in tier_costs(
        cost,
        chunk_tokens=config.chunk_tokens,
        groups=len(config.kv_groups),
        through_host=not config.direct_tier_loads,
    ):
        tier = labels(tier=measured.tier)
        g[("tier_load_seconds_per_chunk", tier)] = measured.load_s_per_chunk
        g[("tier_hit_weight", tier)] = measured.hit_weight
    return g
