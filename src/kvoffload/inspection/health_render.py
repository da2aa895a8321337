"""A :class:`~kvoffload.inspection.tier_health.HealthReport` as a table or as JSON.

The table has one column per tier and one row per counter; ``-`` is a series the
scrape does not have (``None``, or an empty by-direction / by-reason mapping). The
``failed`` and ``integrity errors`` rows are totals; their nonzero parts follow the
table by direction and by reason. Then the host evictions without a lower-tier copy
(when there is a lower tier), the deferrals by reason, the cost model (the prefill
speed, each lane's estimate, verdict and declines, then each tier's load time per
chunk and hit weight for routers, or ``unmeasured``) and the internal errors. The
JSON document is ``dataclasses.asdict`` of the report. Both are deterministic for a
given report.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict

from kvoffload.inspection.render import human_bytes, table
from kvoffload.inspection.tier_health import (
    HOST,
    HealthReport,
    LaneHealth,
    TierCostHealth,
    TierHealth,
)

_ROWS: tuple[tuple[str, Callable[[TierHealth], int | None]], ...] = (
    ("lookups", lambda t: t.lookups),
    ("hit tokens", lambda t: t.hit_tokens),
    ("stored", lambda t: t.transferred.get("store")),
    ("spilled", lambda t: t.transferred.get("spill")),
    ("promoted", lambda t: t.transferred.get("promote")),
    ("loaded", lambda t: t.transferred.get("load")),
    ("failed", lambda t: sum(t.failed.values()) if t.failed else None),
    ("evictions", lambda t: t.evictions),
    ("no room", lambda t: t.no_room),
    (
        "integrity errors",
        lambda t: sum(t.integrity_errors.values()) if t.integrity_errors else None,
    ),
    ("missing chunks", lambda t: t.missing_chunks),
)
_BYTES_ROWS: tuple[tuple[str, Callable[[TierHealth], int | None]], ...] = (
    ("used", lambda t: t.usage_bytes),
    ("capacity", lambda t: t.capacity_bytes),
)


def to_json(report: HealthReport) -> str:
    return json.dumps(asdict(report), indent=2)


def to_text(report: HealthReport) -> str:
    """The report as a table and notes, ending with a newline."""
    rows = [["COUNTER", *(t.tier for t in report.tiers)]]
    for label, get in _ROWS:
        rows.append([label, *(_cell(get(t), str) for t in report.tiers)])
    for label, get in _BYTES_ROWS:
        rows.append([label, *(_cell(get(t), human_bytes) for t in report.tiers)])
    if any(t.codec_ratio is not None for t in report.tiers):
        rows.append(["codec ratio", *(_ratio(t.codec_ratio) for t in report.tiers)])
    right = [False] + [True] * len(report.tiers)
    out = [f"kvoffload metrics at {report.location}", "", *table(rows, right), ""]
    failed = _parts({t.tier: t.failed for t in report.tiers})
    out += [f"failed chunks by direction: {failed}"] if failed else []
    integrity = _parts({t.tier: t.integrity_errors for t in report.tiers})
    out += [f"integrity errors by reason: {integrity}"] if integrity else []
    host = next(t for t in report.tiers if t.tier == HOST)
    if host.evicted_without_copy is not None:
        out.append(f"host evictions without a lower-tier copy: {_without_copy(host)}")
    deferrals = " ".join(f"{r}={n}" for r, n in report.deferrals.items())
    timeouts = _cell(report.deferral_timeouts, str)
    out.append(
        f"deferrals: {sum(report.deferrals.values())}"
        + (f" ({deferrals})" if deferrals else "")
        + f"; timed out: {timeouts}"
    )
    out += _cost_lines(report)
    errors = _cell(report.internal_errors, str)
    if report.internal_errors:
        errors += " (offloading is off for the rest of the engine's life)"
    out.append(f"internal errors: {errors}")
    return "\n".join(out) + "\n"


def _ratio(value: float | None) -> str:
    """``2.00x``: raw bytes per byte a tier keeps (its codec)."""
    return "-" if value is None else f"{value:.2f}x"


def _cell(value: int | None, show: Callable[[int], str]) -> str:
    return "-" if value is None else show(value)


def _parts(by_tier: dict[str, dict[str, int]]) -> str:
    """``disk spill=2 promote=1; redis load=1``: the nonzero counts of each tier."""
    tiers = []
    for tier, counts in by_tier.items():
        nonzero = " ".join(f"{k}={n}" for k, n in counts.items() if n)
        if nonzero:
            tiers.append(f"{tier} {nonzero}")
    return "; ".join(tiers)


def _without_copy(host: TierHealth) -> str:
    n = host.evicted_without_copy
    if host.evicted_without_copy_share is None:
        return f"{n} (no host evictions)"
    return f"{n} ({host.evicted_without_copy_share:.1%} of {host.evictions} host evictions)"


def _cost_lines(report: HealthReport) -> list[str]:
    """``load or recompute: prefill 3200 tokens/s``, one line per lane, then the hit
    weights for routers, one line per tier."""
    measured = any(t.load_s_per_chunk is not None for t in report.tier_costs)
    if report.prefill_tokens_per_s is None and not report.lanes and not measured:
        return []
    rate = report.prefill_tokens_per_s
    out = [f"load or recompute: prefill {'-' if rate is None else f'{rate:.0f}'} tokens/s"]
    out += [f"  {_lane(lane)}" for lane in report.lanes]
    if report.tier_costs:
        out.append("hit weights for routers (prefill time a hit token saves; one-chunk load):")
        out += [f"  {_tier_cost(t)}" for t in report.tier_costs]
    return out


def _tier_cost(t: TierCostHealth) -> str:
    """``disk: 12.00 ms/chunk, weight 0.25``, or ``disk: unmeasured``."""
    if t.load_s_per_chunk is None:
        return f"{t.tier}: unmeasured"
    weight = "-" if t.hit_weight is None else f"{t.hit_weight:.2f}"
    return f"{t.tier}: {1e3 * t.load_s_per_chunk:.2f} ms/chunk, weight {weight}"


def _lane(lane: LaneHealth) -> str:
    verdict = "-" if lane.loads is None else "loads" if lane.loads else "recomputes"
    if lane.seconds_per_chunk is None:
        cost = "unmeasured"
    else:
        cost = (
            f"{1e3 * (lane.latency_s or 0.0):.2f} ms + {1e3 * lane.seconds_per_chunk:.2f} ms/chunk"
        )
    if lane.bytes_per_second is not None:
        cost += f", {human_bytes(round(lane.bytes_per_second))}/s"
    queued = "-" if lane.queued_chunks is None else f"{lane.queued_chunks:.0f}"
    declined = " ".join(f"{r}={n}" for r, n in lane.declined.items() if n)
    return (
        f"{lane.tier}: {verdict} ({cost}; {queued} chunks queued)"
        + (f"; declined {declined}" if declined else "")
        + (f"; probes {lane.probes}" if lane.probes else "")
    )
