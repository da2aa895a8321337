"""Issue 24's prediction: 4 engine replicas over one node-shared host tier of S against
4 private tiers of S/4 each (the same memory), in the simulator.

    nice -n 19 python bench/share_sim.py                    # S = 32, 64, 128 GiB
    python bench/share_sim.py --sizes 64GiB --no-match      # one size, three runs

Workload: the simulator's built-in chat with ``kvoffload simulate``'s defaults (every
conversation starts with the one shared system prompt of 1024 tokens; 1000 users x 8
turns, answers of 128 tokens) but 255 conversations open at once and 20 requests/s,
spread round-robin over the replicas. 255 is not a multiple of 4 on purpose: the
chat trace takes the open conversations in turn, so with a multiple of 4
round-robin would send every turn of a conversation to the same replica (sticky by
accident); with 255 a conversation moves to another replica every turn, as it does
under round-robin routing of independent users. Each replica: ``--engine-tokens``
of KV (65536 by default: a GPU whose own cache holds a few conversations), the
simulator's default cost model (an 8B model, PCIe Gen4).

Per size S it runs: shared (one tier of S, round-robin), private (S/4 each,
round-robin) and private with sticky routing (a conversation stays on one replica:
what routers do without a shared tier), and prints mean and p99 time to first
token, hit rates (engine + kvoffload, and kvoffload's), the ratio of mean TTFT
shared / private round-robin against issue 24's target (<= 0.7x), and host memory:
the most bytes held twice across the private tiers and the stores the share spared.
With ``--match`` (default) it also doubles the private tiers (round-robin) from S up
to ``--match-limit`` x S until their hit rate reaches the shared tier's, and prints
the private memory that took: the memory the share saves for the same hit rate (">"
when even the largest was short). One process; the numbers are deterministic.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from typing import Any

from kvoffload.simulate.arguments import build_parser, chunk_tokens_of, config_of, workload_of
from kvoffload.simulate.replica_report import ReplicasResult
from kvoffload.simulate.replicas import ReplicaSetup, run_replicas
from kvoffload.simulate.settings import SimConfig
from kvoffload.simulate.sweep import Workload
from kvoffload.simulate.units import ChunkUnits, format_bytes, parse_size_list

REPLICAS = 4
TARGET = 0.7  # issue 24: mean TTFT shared / private <= 0.7x


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", default="32GiB,64GiB,128GiB", help="S, the shared tier's sizes")
    p.add_argument("--users", type=int, default=1000)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--concurrent-users", type=int, default=255)
    p.add_argument("--rate", type=float, default=20.0, help="requests/s, all replicas")
    p.add_argument("--engine-tokens", type=int, default=65536, help="KV tokens per replica")
    p.add_argument("--match", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--match-limit", type=int, default=8, help="largest private total, x S")
    p.add_argument("--json", help="also write the rows as JSON")
    return p.parse_args(argv)


def run(config: SimConfig, trace: Workload, cpu_bytes: int, **setup: Any) -> ReplicasResult:
    return run_replicas(
        replace(config, cpu_bytes=cpu_bytes),
        ReplicaSetup(REPLICAS, **setup),
        trace.requests(),
    )


def matching_private(
    config: SimConfig, trace: Workload, size: int, goal: float, *, limit: int, at_size: float
) -> tuple[int, float, bool]:
    """(private total, its hit rate, reached): ``size`` (whose rate is ``at_size``),
    then doubling up to ``limit`` x ``size``."""
    factor, rate = 1, at_size
    while rate < goal and factor < limit:
        factor *= 2
        rate = run(config, trace, factor * size, shared=False).total.total_hit_rate
    return factor * size, rate, rate >= goal


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    chat = [
        *("--users", str(args.users), "--turns", str(args.turns)),
        *("--concurrent-users", str(args.concurrent_users), "--rate", str(args.rate)),
        *("--engine-tokens", str(args.engine_tokens)),
    ]
    simulate = build_parser().parse_args(chat)  # everything else: the command's defaults
    trace = workload_of(simulate)
    config = config_of(simulate, chunk_tokens_of(simulate, trace))
    sizes = parse_size_list(args.sizes, "--sizes", ChunkUnits(config.chunk_bytes, None))
    print(f"{REPLICAS} replicas, {trace.describe()}, {args.engine_tokens} KV tokens each")
    print(
        "        S  routing/tier     TTFT mean    p99   hit (eng+kvo)   kvo   "
        "held twice (max)  stores spared"
    )
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    for size in sizes:
        runs = {
            "shared": run(config, trace, size, shared=True),
            "private": run(config, trace, size, shared=False),
            "sticky": run(config, trace, size, shared=False, route="sticky"),
        }
        for name, r in runs.items():
            cb = r.total.chunk_bytes
            label = {"shared": "rr / shared", "private": "rr / private", "sticky": "sticky/private"}
            behind = " (behind the trace!)" if r.total.behind_trace else ""
            print(
                f"  {format_bytes(size):>7}  {label[name]:<14} {r.total.ttft_mean_s:>9.3f} s "
                f"{r.ttft_p99_s:>6.3f} {r.total.total_hit_rate:>13.1%}  {r.total.hit_rate:>6.1%}  "
                f"{format_bytes(r.extra_copies_max * cb):>16}  "
                f"{format_bytes((r.spared_present + r.spared_storing) * cb):>13}{behind}"
            )
        shared, private, sticky = runs["shared"].total, runs["private"].total, runs["sticky"].total
        ratio = shared.ttft_mean_s / private.ttft_mean_s
        verdict = "meets" if ratio <= TARGET else "misses"
        print(
            f"  mean TTFT shared / private {ratio:.2f}x ({verdict} the target <= {TARGET}x); "
            f"shared / sticky private {shared.ttft_mean_s / sticky.ttft_mean_s:.2f}x"
        )
        row: dict[str, Any] = {
            "size_bytes": size,
            "ratio_shared_private": ratio,
            "ratio_shared_sticky": shared.ttft_mean_s / sticky.ttft_mean_s,
            **{
                f"{name}_{key}": value
                for name, r in runs.items()
                for key, value in (
                    ("ttft_mean_s", r.total.ttft_mean_s),
                    ("ttft_p99_s", r.ttft_p99_s),
                    ("total_hit_rate", r.total.total_hit_rate),
                    ("hit_rate", r.total.hit_rate),
                    ("extra_copies_max_bytes", r.extra_copies_max * r.total.chunk_bytes),
                )
            },
        }
        if args.match:
            goal = shared.total_hit_rate
            total, rate, reached = matching_private(
                config, trace, size, goal, limit=args.match_limit, at_size=private.total_hit_rate
            )
            sign = "" if reached else ">"
            print(
                f"  private memory for the shared hit rate ({goal:.1%}): {sign}"
                f"{format_bytes(total)} in all ({rate:.1%}), {sign}{total / size:g}x S"
            )
            row.update(match_bytes=total, match_reached=reached, match_hit_rate=rate)
        rows.append(row)
    print(f"(simulated in {time.perf_counter() - started:.0f} s)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(rows, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
