"""One consistent reading of every kvoffload metric from a scheduler half.

``read_metrics`` flattens the counters the scheduler half, its directories and its
lower tiers keep into the series declared in :data:`kvoffload.core.metrics.METRICS`
(no second set of counters to drift from the first), adds the gauges, and copies the
recorded histograms. It only reads; the caller must hold whatever lock serializes
access to the scheduler half. Cost: O(series) plus one pass over the pin counts of
each directory for the ``pinned_chunks`` gauge (``with_gauges=False`` skips gauges).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvoffload.core.metrics import Series, labels
from kvoffload.core.recorder import Histogram
from kvoffload.core.tiering import DirectoryTier

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
    out = MetricsReading()
    c = out.counters = {series: float(n) for series, n in scheduler.metrics.counters.items()}
    host = scheduler.directory
    chunk_tokens = scheduler.config.chunk_tokens

    def count(name: str, value: float, **pairs: str) -> None:
        c[(name, labels(**pairs))] = float(value)

    for tier in scheduler.tiers.tiers.values():
        ts = tier.stats
        count("lookups_total", ts.lookups, tier=tier.name)
        count("hit_tokens_total", ts.hit_chunks * chunk_tokens, tier=tier.name)
        count("transferred_chunks_total", ts.spilled_chunks, direction="spill", tier=tier.name)
        count("transferred_chunks_total", ts.promoted_chunks, direction="promote", tier=tier.name)
        count("failed_chunks_total", ts.spill_failures, direction="spill", tier=tier.name)
        count("failed_chunks_total", ts.promotion_failures, direction="promote", tier=tier.name)
        count("missing_chunks_total", ts.missing, tier=tier.name)
        if not isinstance(tier, DirectoryTier):
            count("no_room_total", ts.spill_no_room, tier=tier.name)
        for reason, n in ts.integrity_errors.items():
            count("integrity_errors_total", n, tier=tier.name, reason=reason.split(":", 1)[-1])
    out.histograms = dict(scheduler.metrics.histograms)
    if with_gauges:
        g = out.gauges
        g[("jobs_in_flight", ())] = float(len(scheduler.jobs_in_flight()))
        g[("usage_bytes", labels(tier="host"))] = float(len(host) * chunk_bytes)
        g[("capacity_bytes", labels(tier="host"))] = float(host.num_slots * chunk_bytes)
        g[("pinned_chunks", labels(tier="host"))] = float(host.pinned_count)
        for tier in scheduler.tiers.tiers.values():
            g[("usage_bytes", labels(tier=tier.name))] = float(tier.held_count() * chunk_bytes)
            if isinstance(tier, DirectoryTier):
                capacity = tier.directory.num_slots * chunk_bytes
                g[("capacity_bytes", labels(tier=tier.name))] = float(capacity)
                g[("pinned_chunks", labels(tier=tier.name))] = float(tier.directory.pinned_count)
    return out
