"""``--tier-bandwidth``: when a lower tier stops paying, and what load_policy cost does.

For each bandwidth (GB/s, given to every lower tier's lane alike) the same
workload runs twice, under ``load_policy`` ``always`` and ``cost`` (the scheduler
half's own load-or-recompute decision, learning from the simulated lanes' timings as
it would from a real worker's), plus once without kvoffload. The table prints each
run's mean time to first token against the run without kvoffload: where ``always``
goes above 1.0 the tier costs more than it saves, and ``cost`` should stay at or below
both. Deterministic like every simulation; points may run in processes (``jobs``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvoffload.core.errors import UsageError
from kvoffload.simulate.report import SimResult
from kvoffload.simulate.settings import SimConfig
from kvoffload.simulate.sweep import Workload, run_points

POLICIES = ("always", "cost")


@dataclass(frozen=True)
class BandwidthPoint:
    gbps: float
    policy: str
    result: SimResult


def parse_gbps_list(text: str) -> list[float]:
    """``"0.1,0.5,2"`` -> bandwidths in GB/s (each > 0)."""
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"--tier-bandwidth: expected GB/s numbers, got {text!r}") from None
    if not values or any(not v > 0 for v in values):
        raise UsageError(f"--tier-bandwidth: expected numbers > 0, got {text!r}")
    return sorted(set(values))


def run_bandwidth_sweep(
    base: SimConfig,
    workload: Workload,
    bandwidths: Sequence[float],
    *,
    jobs: int = 1,
    progress: Callable[[int], None] | None = None,
) -> tuple[SimResult, list[BandwidthPoint]]:
    """The run without kvoffload and one point per bandwidth x policy."""
    if not base.has_lower_tier:
        options = " or ".join(f"--{name}-bytes" for name in base.tier_bytes)
        raise UsageError(f"--tier-bandwidth: give a lower tier ({options})")
    grid = [(gbps, policy) for gbps in bandwidths for policy in POLICIES]
    tasks = [(base.without_tiers(), workload)]
    for gbps, policy in grid:
        cost = base.cost.with_tier_gbps(gbps)
        tasks.append((replace(base, cost=cost, load_policy=policy), workload))
    results = run_points(tasks, jobs=jobs, progress=progress)
    points = [BandwidthPoint(g, p, r) for (g, p), r in zip(grid, results[1:], strict=True)]
    return results[0], points


def format_bandwidth_sweep(baseline: SimResult, points: Sequence[BandwidthPoint]) -> str:
    """One row per bandwidth: mean TTFT of each policy, relative to no kvoffload, and
    the tokens ``cost`` recomputed instead of loading."""
    base = baseline.ttft_mean_s
    by_key = {(p.gbps, p.policy): p.result for p in points}
    lines = [
        "mean time to first token by lower-tier bandwidth (relative to no kvoffload, "
        f"{base:.3f} s)",
        f"{'tier GB/s':>10}  {'always':>16}  {'cost':>16}  {'recomputed by cost':>18}",
    ]
    for gbps in sorted({p.gbps for p in points}):
        cells = []
        for policy in POLICIES:
            ttft = by_key[(gbps, policy)].ttft_mean_s
            cells.append(f"{ttft:7.3f} s {ttft / base if base else 0.0:5.2f}x")
        declined = sum(by_key[(gbps, "cost")].declined_tokens.values())
        lines.append(f"{gbps:>10g}  {cells[0]:>16}  {cells[1]:>16}  {declined:>11} tokens")
    return "\n".join(lines)


def bandwidth_json(baseline: SimResult, points: Sequence[BandwidthPoint]) -> dict[str, Any]:
    return {
        "without_kvoffload": baseline.as_json(),
        "points": [
            {"tier_gbps": p.gbps, "load_policy": p.policy, "result": p.result.as_json()}
            for p in points
        ],
    }
