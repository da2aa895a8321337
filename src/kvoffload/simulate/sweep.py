"""``--sweep``: hit rate against host memory, for every eviction policy.

Each point (one capacity, one policy) is a full simulation of the same workload;
points run in worker processes (``jobs``), each re-creating the workload from its
description (the chat generator's parameters, or the trace path), so the results
are the same whatever the number of processes. Both the chart (a PNG, one line per
policy) and the printed table (one row per capacity) show prompt tokens served by
the engine's prefix cache and kvoffload together, with the workload's limits when
the points carry them (the offline optimum per capacity, the infinite cache).
"""

from __future__ import annotations

import multiprocessing
import textwrap
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from kvoffload.core.policies import policy_names
from kvoffload.simulate.report import SimResult
from kvoffload.simulate.runner import run_simulation
from kvoffload.simulate.settings import SimConfig
from kvoffload.simulate.trace import TraceRequest, TraceSummary
from kvoffload.simulate.units import format_bytes

_AUTO_POINTS = 8


class Workload(Protocol):
    """A re-creatable, picklable workload (ChatTrace, TraceFile)."""

    def requests(self) -> Iterator[TraceRequest]: ...

    def summary(self, fits: int) -> TraceSummary: ...

    def describe(self) -> str: ...


@dataclass(frozen=True)
class SweepPoint:
    cpu_bytes: int
    policy: str
    result: SimResult


def auto_sizes(unique_bytes: int, chunk_bytes: int) -> list[int]:
    """Eight capacities, doubling, from 1/128 of the smallest power of two that holds
    ``unique_bytes`` (the workload's distinct KV) up to it; none below one chunk."""
    top = 1
    while top < max(unique_bytes, chunk_bytes):
        top *= 2
    sizes = [top >> k for k in range(_AUTO_POINTS - 1, -1, -1)]
    return [s for s in sizes if s >= chunk_bytes] or [chunk_bytes]


def run_point(args: tuple[SimConfig, Workload]) -> SimResult:
    """One simulation of a sweep (picklable: runs in a worker process)."""
    config, workload = args
    return run_simulation(config, workload.requests())


def run_sweep(
    base: SimConfig,
    workload: Workload,
    sizes: Sequence[int],
    *,
    jobs: int = 1,
    progress: Callable[[int], None] | None = None,
) -> list[SweepPoint]:
    """Simulate ``workload`` for every size x policy (sizes x policies, in that
    order); ``jobs`` > 1 runs points in that many processes. ``progress`` is called
    with 1 per finished point."""
    grid = [(size, policy) for size in sizes for policy in policy_names()]
    tasks = [(replace(base, cpu_bytes=size, eviction=policy), workload) for size, policy in grid]
    results = run_points(tasks, jobs=jobs, progress=progress)
    return [SweepPoint(size, policy, r) for (size, policy), r in zip(grid, results, strict=True)]


def run_points(
    tasks: Sequence[tuple[SimConfig, Workload]],
    *,
    jobs: int = 1,
    progress: Callable[[int], None] | None = None,
) -> list[SimResult]:
    """Simulate each task (settings, workload), in order; ``jobs`` > 1 runs them in
    that many processes. ``progress`` is called with 1 per finished point."""
    results: list[SimResult] = []
    if jobs <= 1 or len(tasks) == 1:
        for task in tasks:
            results.append(run_point(task))
            if progress is not None:
                progress(1)
        return results
    with multiprocessing.get_context().Pool(min(jobs, len(tasks))) as pool:
        for result in pool.imap(run_point, tasks):
            results.append(result)
            if progress is not None:
                progress(1)
    return results


def format_sweep(points: Sequence[SweepPoint]) -> str:
    """A table: one row per capacity, the hit rate (engine + kvoffload) of each
    policy, the optimum and infinite-cache limits (when known) and the engine's own
    prefix-cache share."""
    policies = sorted({p.policy for p in points})
    sizes = sorted({p.cpu_bytes for p in points})
    by_key = {(p.cpu_bytes, p.policy): p.result for p in points}
    limits = any(p.result.bounds is not None for p in points)
    extra = f"{'optimum':>9}{'infinite':>9}" if limits else ""
    header = f"{'host memory':>12}  " + "".join(f"{name:>9}" for name in policies) + extra
    lines = ["hit rate (engine + kvoffload) by host memory and eviction policy", header]
    for size in sizes:
        row = [by_key[(size, name)] for name in policies]
        rates = "".join(f"{100 * r.total_hit_rate:8.1f}%" for r in row)
        b = row[0].bounds
        if b is not None:
            rates += f"{100 * b.optimum_rate:8.1f}%{100 * b.infinite_rate:8.1f}%"
            chunks = f" ({b.capacity_chunks} chunks)"
        else:
            chunks = ""
        lines.append(
            f"{format_bytes(size):>12}  {rates}   engine alone {100 * row[0].engine_hit_rate:.1f}%"
            + chunks
        )
    return "\n".join(lines)


def sweep_json(points: Sequence[SweepPoint]) -> list[dict[str, Any]]:
    return [
        {"cpu_bytes": p.cpu_bytes, "policy": p.policy, "result": p.result.as_json()} for p in points
    ]


def plot_sweep(
    points: Sequence[SweepPoint], path: str, title: str, ticks: dict[int, str] | None = None
) -> list[str]:
    """Write the PNG chart of ``points`` to ``path``: hit rate against host memory
    (log scale), one line per policy, then the optimum and the infinite cache when
    every point carries its bounds; return the lines drawn, in legend order.
    ``ticks``: a label per size (default: the size in bytes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    policies = sorted({p.policy for p in points})
    for policy in policies:
        mine = sorted((p for p in points if p.policy == policy), key=lambda p: p.cpu_bytes)
        xs = [p.cpu_bytes / 2**30 for p in mine]
        ax.plot(xs, [100 * p.result.total_hit_rate for p in mine], marker="o", label=policy)
    first = sorted((p for p in points if p.policy == policies[0]), key=lambda p: p.cpu_bytes)
    limits = [(p.cpu_bytes / 2**30, p.result.bounds) for p in first]
    if all(b is not None for _, b in limits):
        xs = [x for x, _ in limits]
        optimum = [100 * b.optimum_rate for _, b in limits if b is not None]
        infinite = [100 * b.infinite_rate for _, b in limits if b is not None]
        ax.plot(xs, optimum, color="black", linestyle="--", marker="x", label="optimum")
        ax.plot(xs, infinite, color="gray", linestyle=":", label="infinite cache")
    ax.set_xscale("log", base=2)
    sizes = sorted({p.cpu_bytes for p in points})
    labels = [(ticks or {}).get(size) or format_bytes(size) for size in sizes]
    ax.set_xticks([size / 2**30 for size in sizes], labels)
    ax.minorticks_off()
    ax.set_xlabel("host memory for kvoffload")
    ax.set_ylabel("prompt tokens served, engine + kvoffload (%)")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(title="eviction")
    ax.set_title("\n".join(textwrap.wrap(title, 90)), fontsize=9)
    fig.tight_layout()
    try:
        fig.savefig(path, format="png", dpi=110)
    finally:
        plt.close(fig)
    return [str(line.get_label()) for line in ax.get_lines()]
