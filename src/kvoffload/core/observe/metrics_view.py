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

from collections.abc import Mapping
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
    scheduler: OffloadScheduler,
    chunk_bytes: int | Mapping[str, int],
    *,
    raw_chunk_bytes: int | None = None,
    with_gauges: bool = True,
) -> MetricsReading:
    """``chunk_bytes``: one chunk's bytes, all workers together, as every tier keeps
    it, or each tier's by name (``"host"`` for a tier not named); ``raw_chunk_bytes``:
    as the engine's KV holds it (None: as host memory keeps it)."""
    recorder = scheduler.metrics
    out = MetricsReading(
        counters={series: float(n) for series, n in recorder.counters.items()},
        histograms=dict(recorder.histograms),
    )
    if with_gauges:
        sizes = {"host": chunk_bytes} if isinstance(chunk_bytes, int) else dict(chunk_bytes)
        out.gauges = _gauges(scheduler, sizes, raw_chunk_bytes or sizes["host"])
    return out


def _gauges(scheduler: OffloadScheduler, sizes: dict[str, int], raw: int) -> dict[Series, float]:
    host, host_bytes = scheduler.directory, sizes["host"]
    g: dict[Series, float] = {("jobs_in_flight", ()): float(len(scheduler.jobs_in_flight()))}
    g[("usage_bytes", labels(tier="host"))] = float(len(host) * host_bytes)
    g[("capacity_bytes", labels(tier="host"))] = float(host.num_slots * host_bytes)
    g[("pinned_chunks", labels(tier="host"))] = float(host.pinned_count)
    g[("codec_ratio", labels(tier="host"))] = raw / host_bytes
    g.update(_cost_gauges(scheduler))
    for tier in scheduler.tiers.tiers.values():
        chunk_bytes = sizes.get(tier.name, host_bytes)
        g[("usage_bytes", labels(tier=tier.name))] = float(tier.held_count() * chunk_bytes)
        quarantined = scheduler.moves.quarantine.chunks(tier.name)
        g[("quarantined_chunks", labels(tier=tier.name))] = float(quarantined)
        g[("codec_ratio", labels(tier=tier.name))] = _stored_ratio(
            scheduler, tier.name, raw, chunk_bytes
        )
        if isinstance(tier, DirectoryTier):
            capacity = tier.directory.num_slots * chunk_bytes
            g[("capacity_bytes", labels(tier=tier.name))] = float(capacity)
            g[("pinned_chunks", labels(tier=tier.name))] = float(tier.directory.pinned_count)
    return g


def _stored_ratio(scheduler: OffloadScheduler, tier: str, raw: int, chunk_bytes: int) -> float:
    """Raw bytes over what tier ``tier`` wrote of the chunks it stored (its workers
    report the bytes as the tier keeps them), or over its slots' bytes before any."""
    metrics = scheduler.metrics
    chunks = metrics.counters.get(
        ("transferred_chunks_total", labels(direction="spill", tier=tier)), 0
    )
    written = metrics.histograms.get(("transfer_bytes", labels(direction="spill", tier=tier)))
    if chunks and written is not None and written.total > 0:
        return chunks * raw / written.total
    return raw / chunk_bytes


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
