"""Every eviction policy against the offline optimum on a real trace, in one run.

    nice -n 19 python bench/traces.py                  # the shared Mooncake trace
    python bench/traces.py --head 2000 --shares 5,25   # a quick look

For each host capacity, a share of the trace's distinct chunks (5, 10, 25 and 50% by
default: for a Mooncake trace at its 512-token block, its distinct hash ids), it
simulates the trace with every registered eviction policy
(:func:`kvoffload.core.policies.policy_names`, so a new policy shows up once
registered) under the simulator's default engine and cost model, and computes the
infinite-cache bound and the offline optimum at that capacity
(:mod:`kvoffload.simulate.optimum`). It prints a table (hit rate = prompt tokens
served by the engine's prefix cache and kvoffload / prompt tokens, and each policy's
share of the optimum) and writes the sweep chart (``--output``). Runs that fell
behind the trace (see ``kvoffload simulate``) are marked ``!``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from decimal import Decimal
from pathlib import Path

from kvoffload.core.errors import KvOffloadError
from kvoffload.core.policies import policy_names
from kvoffload.simulate.mooncake import MOONCAKE
from kvoffload.simulate.optimum import bounds, chunk_references, infinite_hit_tokens
from kvoffload.simulate.settings import SimConfig
from kvoffload.simulate.sweep import SweepPoint, plot_sweep, run_sweep, sweep_json
from kvoffload.simulate.trace import TraceFile
from kvoffload.simulate.units import format_bytes

SHARED_TRACE = Path(__file__).resolve().parents[2] / "shared/traces/mooncake-conversation.jsonl"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trace", default=str(SHARED_TRACE), help="a trace (default: the shared one)")
    p.add_argument("--head", type=int, help="only the first N requests")
    p.add_argument("--time-scale", type=float, default=1.0, help="arrival times x F")
    p.add_argument("--shares", default="5,10,25,50", help="host capacities, %% of distinct chunks")
    p.add_argument("--chunk-tokens", type=int, help="default: a Mooncake trace's block, or 256")
    p.add_argument("--jobs", type=int, default=1, help="simulations in parallel (1)")
    p.add_argument("--output", default="traces.png", help="the chart (PNG)")
    p.add_argument("--json", help="also write the points as JSON")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    workload = TraceFile(args.trace, args.head, args.time_scale)
    chunk_tokens = args.chunk_tokens or (
        workload.block_tokens if workload.format == MOONCAKE else SimConfig(0).chunk_tokens
    )
    base = SimConfig(cpu_bytes=0, chunk_tokens=chunk_tokens)
    started = time.perf_counter()
    refs = chunk_references(workload.requests(), chunk_tokens, base.block_size)
    infinite = infinite_hit_tokens(refs)
    shares = [Decimal(s) for s in args.shares.split(",") if s.strip()]
    capacity = {share: int(share * refs.distinct / 100) for share in shares}
    limits = {share: bounds(refs, capacity[share], infinite) for share in shares}
    limits_s = time.perf_counter() - started
    print(
        f"{workload.describe()}: {len(refs.prompts)} requests, {refs.prompt_tokens} prompt "
        f"tokens, {refs.distinct} distinct chunks of {chunk_tokens} tokens; limits in "
        f"{limits_s:.1f} s",
        flush=True,
    )
    sizes = [capacity[share] * base.chunk_bytes for share in shares]
    points = run_sweep(base, workload, sizes, jobs=args.jobs)
    share_of = {capacity[share] * base.chunk_bytes: share for share in shares}
    for point in points:
        point.result.bounds = limits[share_of[point.cpu_bytes]]
    print(table(points, shares, capacity, base.chunk_bytes))
    ticks = {
        capacity[share]
        * base.chunk_bytes: f"{share}%\n{format_bytes(capacity[share] * base.chunk_bytes)}"
        for share in shares
    }
    plot_sweep(points, args.output, workload.describe(), ticks)
    print(f"wrote the chart to {args.output} ({time.perf_counter() - started:.0f} s in all)")
    if args.json:
        Path(args.json).write_text(json.dumps(sweep_json(points), indent=2) + "\n")
    return 0


def table(
    points: list[SweepPoint], shares: list[Decimal], capacity: dict[Decimal, int], chunk: int
) -> str:
    """One row per capacity: the limits, then each policy's hit rate and its share of
    the optimum (``!``: that run fell behind the trace)."""
    names = policy_names()
    by_key = {(p.cpu_bytes, p.policy): p.result for p in points}
    head = f"{'host capacity':>22} {'optimum':>8} {'infinite':>8}" + "".join(
        f"{name:>18}" for name in names
    )
    lines = ["hit rate (engine + kvoffload), and share of the optimum", head]
    for share in shares:
        size = capacity[share] * chunk
        first = by_key[(size, names[0])]
        b = first.bounds
        assert b is not None
        row = f"{f'{share}% ({capacity[share]} chunks)':>22} {b.optimum_rate:8.2%} "
        row += f"{b.infinite_rate:8.2%}"
        for name in names:
            r = by_key[(size, name)]
            mark = "!" if r.behind_trace else " "
            row += f"   {r.total_hit_rate:6.2%} ({r.share_of_optimum or 0:4.0%}){mark}"
        lines.append(row)
    if any(p.result.behind_trace for p in points):
        lines.append("! the simulated engine fell behind the trace (see kvoffload simulate)")
    return "\n".join(lines)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KvOffloadError as exc:
        sys.exit(f"bench/traces.py: error: {exc}")
