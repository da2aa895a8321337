"""Directory throughput and memory at 1,000,000 slots, per eviction policy.

Measures, on a full directory in steady state (it has already evicted):
- lookup of a 1,000-chunk prefix that is entirely readable,
- prepare_store + complete_store of 16 new chunks, each needing an eviction,
- memory per tracked chunk (tracemalloc, the directory and the keys it holds).

Targets: lookup of 1,000 chunks <= 200 us; <= 300 bytes per tracked chunk.
Prints medians over several runs. Usage: ``python bench/directory.py [--slots N]``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
import tracemalloc

from kvoffload.core.directory import Directory
from kvoffload.core.keys import ChunkKey
from kvoffload.core.policies import policy_names


def fill(d: Directory, n: int, batch: int = 4096) -> list[ChunkKey]:
    keys = [ChunkKey(os.urandom(16)) for _ in range(n)]
    for i in range(0, n, batch):
        prep = d.prepare_store(keys[i : i + batch])
        d.complete_store(prep.keys, success=True)
    d.take_events()
    return keys


def steady_state(policy: str, slots: int) -> tuple[Directory, list[ChunkKey]]:
    d = Directory(slots, policy=policy)
    fill(d, slots)
    # Push 10% more through so ghost lists and queues reach their steady shape.
    fill(d, slots // 10)
    resident = d.present_keys()
    return d, resident


def time_lookup(d: Directory, prefix: list[ChunkKey], reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        d.lookup(prefix)
    return (time.perf_counter() - t0) / reps


def time_store(d: Directory, reps: int) -> float:
    batches = [[ChunkKey(os.urandom(16)) for _ in range(16)] for _ in range(reps)]
    t0 = time.perf_counter()
    for keys in batches:
        prep = d.prepare_store(keys)
        d.complete_store(prep.keys, success=True)
    elapsed = (time.perf_counter() - t0) / reps
    d.take_events()
    return elapsed


def bytes_per_chunk(policy: str, slots: int) -> float:
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    d, resident = steady_state(policy, slots)
    del resident
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    tracked = len(d)
    del d
    return used / tracked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--memory-slots", type=int, default=None, help="default: --slots")
    args = parser.parse_args()
    print(f"directory benchmark: {args.slots:,} slots, medians of {args.runs} runs")
    columns = f"{'lookup 1000 (us)':>17} {'store 16 + evict (us)':>22} {'bytes/chunk':>12}"
    print(f"{'policy':8} {columns}")
    for policy in policy_names():
        d, resident = steady_state(policy, args.slots)
        prefix = resident[:1000]
        assert d.lookup(prefix).readable_prefix == 1000
        lookups = [time_lookup(d, prefix, 200) * 1e6 for _ in range(args.runs)]
        stores = [time_store(d, 500) * 1e6 for _ in range(args.runs)]
        d.check_integrity()
        del d, resident, prefix
        gc.collect()
        mem = bytes_per_chunk(policy, args.memory_slots or args.slots)
        print(
            f"{policy:8} {statistics.median(lookups):17.1f} {statistics.median(stores):22.1f} "
            f"{mem:12.0f}"
        )
    print("targets: lookup <= 200 us, <= 300 bytes per tracked chunk")


if __name__ == "__main__":
    main()
