"""The tier hierarchy's health from a running engine's kvoffload counters.

:func:`tier_health` turns the samples of one scrape (:mod:`.exposition`) into a
:class:`HealthReport`: per tier (in the registry's order, host memory first:
:func:`~kvoffload.tiers.registry.tier_names`; then any other tier name, sorted) the
counters of :data:`kvoffload.core.observe.metrics.METRICS` that tell how it is doing,
and the hierarchy's deferrals, deferral timeouts and internal errors. Only
``kvoffload_*`` samples are read; samples that differ only in labels kvoffload does
not declare (vLLM's ``engine`` and ``model_name``: several engines behind one
``/metrics``) are summed.

A field is ``None`` (a mapping: empty) when the scrape has no sample of that series:
on kvoffload's own endpoint (``metrics_port``) every series that applies to a tier
is there from the start, at 0, so ``None`` means it does not apply (a Redis tier's
evictions: the server evicts on its own, uncounted), except for series that appear
only once counted (integrity errors by reason); on vLLM's ``/metrics`` a series
appears when it first moves, so ``None`` means nothing was counted yet. Pure: no I/O.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvoffload.core.observe.metrics import PREFIX
from kvoffload.inspection.exposition import Exposition, Sample
from kvoffload.tiers.registry import HOST as HOST_TIER
from kvoffload.tiers.registry import tier_names

HOST = HOST_TIER.name
DIRECTIONS = ("store", "spill", "promote", "load")
"""``direction`` label values in the order shown (engine -> host -> tier -> host -> engine)."""


@dataclass(frozen=True)
class TierHealth:
    """One tier's counters (module docstring for ``None``). ``transferred`` and
    ``failed``: chunks by ``direction`` (store: engine to host; spill: host to this
    tier; promote: this tier to host; load: into the engine, from host memory or, for
    a lower tier, straight from it). ``integrity_errors``: chunks read back that
    failed verification, by reason. ``evicted_without_copy``: host only, with a lower
    tier: host evictions of chunks no lower tier held (0 when a lower tier is there
    but the series is not: on vLLM's ``/metrics``, not moved yet; ``None`` for the
    other tiers and without a lower tier); ``evicted_without_copy_share`` is its share
    of ``evictions`` (``None`` without host evictions)."""

    tier: str
    lookups: int | None
    hit_tokens: int | None
    transferred: dict[str, int]
    failed: dict[str, int]
    evictions: int | None
    no_room: int | None
    integrity_errors: dict[str, int]
    missing_chunks: int | None
    usage_bytes: int | None
    capacity_bytes: int | None
    evicted_without_copy: int | None
    evicted_without_copy_share: float | None
    codec_ratio: float | None = None  # raw bytes per byte the tier keeps (decision 0023)


@dataclass(frozen=True)
class LaneHealth:
    """One lane of the load-or-recompute cost model (decision 0013), from its gauges:
    ``latency_s`` and ``seconds_per_chunk`` learned from its jobs (None: unmeasured),
    ``bytes_per_second``, ``queued_chunks`` in flight, ``loads`` (its standing
    verdict), ``declined``: hits it recomputed, by reason, and ``probes``: loads that
    re-measured it while it was declined."""

    tier: str
    latency_s: float | None
    seconds_per_chunk: float | None
    bytes_per_second: float | None
    queued_chunks: float | None
    loads: bool | None
    declined: dict[str, int]
    probes: int = 0


@dataclass(frozen=True)
class TierCostHealth:
    """One tier's figures for routers (:mod:`kvoffload.core.cost.hit_weights`):
    ``load_s_per_chunk``, the learned time to load one chunk from it, and
    ``hit_weight``, the share of prefill time a token hit in it saves; None:
    unmeasured. Several engines behind one ``/metrics``: their mean."""

    tier: str
    load_s_per_chunk: float | None
    hit_weight: float | None


@dataclass(frozen=True)
class HealthReport:
    """``location``: the URL read. ``deferrals``: lookups answered retry-later, by
    reason; ``deferral_timeouts``: deferrals that gave up (the request recomputed);
    ``internal_errors``: errors caught at the engine boundary (after the first,
    offloading is off); ``prefill_tokens_per_s`` and ``lanes``: the cost model;
    ``tier_costs``: each tier's figures for routers, in ``tiers``' order."""

    location: str
    tiers: list[TierHealth]
    deferrals: dict[str, int]
    deferral_timeouts: int | None
    internal_errors: int | None
    prefill_tokens_per_s: float | None = None
    lanes: list[LaneHealth] = field(default_factory=list)
    tier_costs: list[TierCostHealth] = field(default_factory=list)


def has_kvoffload_metrics(exposition: Exposition) -> bool:
    """Whether the scrape names any kvoffload metric (a sample or a HELP/TYPE line)."""
    return any(s.name.startswith(PREFIX) for s in exposition.samples) or any(
        name.startswith(PREFIX) for name in exposition.announced
    )


def tier_health(exposition: Exposition, location: str) -> HealthReport:
    """The report of one scrape. Raises ``ValueError`` (one line) when a kvoffload
    sample read here is not a finite count (NaN, infinite, negative or fractional)."""
    series = _Series(s for s in exposition.samples if s.name.startswith(PREFIX))
    seen = {s.label("tier") for s in series.samples} - {None, HOST}
    known = tier_names()  # read now: the registry's order, host memory first
    names = [HOST, *(t for t in known[1:] if t in seen)]
    names += sorted(t for t in seen if t is not None and t not in known)
    tiers = [_tier(series, name, lower=len(names) > 1) for name in names]
    return HealthReport(
        location=location,
        tiers=tiers,
        deferrals=series.by("deferrals_total", "reason"),
        deferral_timeouts=series.total("deferral_timeouts_total"),
        internal_errors=series.total("internal_errors_total"),
        prefill_tokens_per_s=series.gauge("cost_prefill_tokens_per_second"),
        lanes=_lanes(series, names),
        tier_costs=[
            TierCostHealth(
                tier=name,
                load_s_per_chunk=series.mean("tier_load_seconds_per_chunk", tier=name),
                hit_weight=series.mean("tier_hit_weight", tier=name),
            )
            for name in names
        ],
    )


def _lanes(series: _Series, tiers: list[str]) -> list[LaneHealth]:
    """The cost model's lanes the scrape names (a verdict or a decline), in tier order."""
    lanes = []
    for tier in tiers:
        verdict = series.gauge("cost_lane_loads", tier=tier)
        declined = {r: n for r, n in series.by("hits_declined_total", "reason", tier=tier).items()}
        if verdict is None and not any(declined.values()):
            continue
        lanes.append(
            LaneHealth(
                tier=tier,
                latency_s=series.gauge("cost_lane_latency_seconds", tier=tier),
                seconds_per_chunk=series.gauge("cost_lane_seconds_per_chunk", tier=tier),
                bytes_per_second=series.gauge("cost_lane_bytes_per_second", tier=tier),
                queued_chunks=series.gauge("cost_lane_queued_chunks", tier=tier),
                loads=None if verdict is None else verdict > 0,
                declined=declined,
                probes=series.total("cost_probes_total", tier=tier) or 0,
            )
        )
    return lanes


def _tier(series: _Series, tier: str, *, lower: bool) -> TierHealth:
    evictions = series.total("evictions_total", tier=tier)
    without_copy = None
    if tier == HOST:
        without_copy = series.total("evicted_without_copy_total", tier=tier)
        if without_copy is None and lower:
            without_copy = 0  # on vLLM's /metrics: not moved yet (the tier is there)
    share = None
    if without_copy is not None and evictions:
        share = without_copy / evictions
    return TierHealth(
        tier=tier,
        lookups=series.total("lookups_total", tier=tier),
        hit_tokens=series.total("hit_tokens_total", tier=tier),
        transferred=_ordered(series.by("transferred_chunks_total", "direction", tier=tier)),
        failed=_ordered(series.by("failed_chunks_total", "direction", tier=tier)),
        evictions=evictions,
        no_room=series.total("no_room_total", tier=tier),
        integrity_errors=series.by("integrity_errors_total", "reason", tier=tier),
        missing_chunks=series.total("missing_chunks_total", tier=tier),
        usage_bytes=series.total("usage_bytes", tier=tier),
        capacity_bytes=series.total("capacity_bytes", tier=tier),
        evicted_without_copy=without_copy,
        evicted_without_copy_share=share,
        codec_ratio=series.mean("codec_ratio", tier=tier),
    )


def _ordered(by_direction: dict[str, int]) -> dict[str, int]:
    rank = {d: i for i, d in enumerate(DIRECTIONS)}
    return dict(sorted(by_direction.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0])))


class _Series:
    """The kvoffload samples of one scrape, by metric name without the prefix."""

    def __init__(self, samples: Iterable[Sample]) -> None:
        self.samples = list(samples)
        self._by_name: dict[str, list[Sample]] = {}
        for s in self.samples:
            self._by_name.setdefault(s.name.removeprefix(PREFIX), []).append(s)

    def total(self, name: str, **pairs: str) -> int | None:
        """The sum of ``name``'s samples whose labels include ``pairs``; None if none."""
        matching = self._matching(name, pairs)
        return sum(_count(s) for s in matching) if matching else None

    def gauge(self, name: str, **pairs: str) -> float | None:
        """The sum of ``name``'s finite samples whose labels include ``pairs``; None if
        none (gauges: any finite value)."""
        values = [s.value for s in self._matching(name, pairs) if math.isfinite(s.value)]
        return sum(values) if values else None

    def mean(self, name: str, **pairs: str) -> float | None:
        """The mean of those finite samples (a figure per engine, not a share of a
        total); None if none."""
        values = [s.value for s in self._matching(name, pairs) if math.isfinite(s.value)]
        return sum(values) / len(values) if values else None

    def by(self, name: str, label: str, **pairs: str) -> dict[str, int]:
        """Those sums per value of ``label``, sorted by it (samples without it: not counted)."""
        out: dict[str, int] = {}
        for s in self._matching(name, pairs):
            value = s.label(label)
            if value is not None:
                out[value] = out.get(value, 0) + _count(s)
        return dict(sorted(out.items()))

    def _matching(self, name: str, pairs: dict[str, str]) -> list[Sample]:
        return [
            s for s in self._by_name.get(name, []) if all(s.label(k) == v for k, v in pairs.items())
        ]


def _count(sample: Sample) -> int:
    v = sample.value
    if not math.isfinite(v) or v < 0 or not v.is_integer():
        pairs = ",".join(f'{k}="{value}"' for k, value in sample.labels)
        raise ValueError(f"{sample.name}{{{pairs}}} is {v!r}, not a count")
    return int(v)
