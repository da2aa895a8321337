"""The node-shared host tier's directory calls: a private Directory against a share's
client (one round trip to the node process per call), with 1 and 4 engines at once.

Measures, per call (median and p99 over ``--reps``, each engine process timing its own):
- ``readable_prefix`` and ``lookup`` of a 1,000-chunk prefix that is entirely readable
  (the share's client answers ``readable_prefix`` from the shared-memory index, and
  ``lookup`` with one round trip; "prefix 1k, round trip" asks the node process),
- ``prepare_store`` + ``complete_store`` of 16 new chunks (steady state: each evicts),
- ``touch`` of the 1,000 chunks (the share's client sends it one way: no reply),
- the first prototype of decision 0016's design (b), kept for reference: a lookup of
  1,000 keys in a bare numpy hash table (one probe, no locking).

Budget: a lookup of 1,000 chunks <= 200 us. Prints each measurement's ratio to the
private directory measured in the same run, and to the budget.
Usage: ``python bench/share.py [--reps N] [--engines 1,4]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvoffload.core.directory import Directory
from kvoffload.core.keys import ChunkKey
from kvoffload.share.client import ShareDirectory
from kvoffload.share.launch import spawn_server
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.paths import SharePaths
from kvoffload.share.protocol import Op, pack_keys

SLOTS = 300_000
PREFIX = 1000
BUDGET_US = 200.0


def timed(fn: Callable[[], object], reps: int) -> tuple[float, float]:
    """Median and p99 of ``fn`` in microseconds."""
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e6)
    samples.sort()
    return statistics.median(samples), samples[int(len(samples) * 0.99)]


def keys(n: int) -> list[ChunkKey]:
    return [ChunkKey(os.urandom(16)) for _ in range(n)]


def store_pair(d: Directory | ShareDirectory) -> Callable[[], object]:
    def pair() -> None:
        prepared = d.prepare_store(keys(16))
        d.complete_store(prepared.keys, success=True)

    return pair


def measure(
    d: Directory | ShareDirectory, prefix: list[ChunkKey], reps: int
) -> dict[str, tuple[float, float]]:
    timings = {
        "readable_prefix 1k": timed(lambda: d.readable_prefix(prefix), reps),
        "lookup 1k": timed(lambda: d.lookup(prefix), reps),
        "store+complete 16": timed(store_pair(d), reps),
        "touch 1k": timed(lambda: d.touch(prefix), reps),
    }
    if isinstance(d, ShareDirectory):  # the same question as one round trip (no index)
        packed = pack_keys(prefix)
        timings["prefix 1k, round trip"] = timed(lambda: d.link.call(Op.PREFIX, packed), reps)
    return timings


def engine(root: str, prefix: bytes, reps: int, start: Any, out: Any) -> None:
    """One engine process: its own client, timing its own calls."""
    d = ShareDirectory(SharePaths("bench", Path(root)), timeout_s=1.0, start_server=False)
    assert d.wait_ready(30.0)
    chunk_keys = [ChunkKey(prefix[i : i + 16]) for i in range(0, len(prefix), 16)]
    d.touch(chunk_keys)
    start.wait()
    out.put(measure(d, chunk_keys, reps))
    d.close()


def shm_index_lookup(prefix: list[ChunkKey], reps: int) -> tuple[float, float]:
    """Design (b)'s read side: open addressing over (hi, lo, state) u64 rows."""
    capacity = 1 << 18
    table = np.zeros((capacity, 3), dtype=np.uint64)
    packed = np.frombuffer(b"".join(prefix), dtype=np.uint64).reshape(-1, 2)
    for hi, lo in packed:
        bucket = int(lo) & (capacity - 1)
        while table[bucket, 2]:
            bucket = (bucket + 1) & (capacity - 1)
        table[bucket] = (hi, lo, 2)
    raw = b"".join(prefix)

    def lookup() -> int:
        k = np.frombuffer(raw, dtype=np.uint64).reshape(-1, 2)
        rows = table[(k[:, 1] & np.uint64(capacity - 1)).astype(np.int64)]
        ok = (rows[:, 0] == k[:, 0]) & (rows[:, 1] == k[:, 1]) & (rows[:, 2] == 2)
        return len(ok) if ok.all() else int(np.argmin(ok))

    return timed(lookup, reps)


def report(
    name: str, result: dict[str, tuple[float, float]], base: dict[str, tuple[float, float]]
) -> None:
    for what, (p50, p99) in result.items():
        ratio = p50 / base.get(what, base["readable_prefix 1k"])[0]
        budget = f", {p50 / BUDGET_US:.2f}x budget" if "1k" in what else ""
        times = f"p50 {p50:8.1f} us  p99 {p99:8.1f} us"
        print(f"  {name:<22} {what:<20} {times}  ({ratio:.2f}x private{budget})")


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--engines", default="1,4")
    args = parser.parse_args()
    prefix = keys(PREFIX)
    private = Directory(SLOTS)
    for _ in range(SLOTS // 16):
        store_pair(private)()  # fill: the store pairs below evict, as in steady state
    private.complete_store(private.prepare_store(prefix).keys, success=True)
    base = measure(private, prefix, args.reps)
    print(f"directory calls, {SLOTS} slots, budget {BUDGET_US:.0f} us per 1k-chunk lookup")
    report("private Directory", base, base)

    root = tempfile.mkdtemp(prefix="kvs-bench-", dir="/tmp")
    paths = SharePaths("bench", Path(root))
    spawned = spawn_server(paths, ShareGeometry(SLOTS, 64))
    assert spawned is not None and spawned.wait_ready(60.0)
    try:
        d = ShareDirectory(paths, timeout_s=1.0, start_server=False)
        assert d.wait_ready(30.0)
        for _ in range(SLOTS // 16):
            store_pair(d)()
        d.complete_store(d.prepare_store(prefix).keys, success=True)
        d.close()
        context = mp.get_context("spawn")
        packed = b"".join(prefix)
        for n in (int(x) for x in args.engines.split(",")):
            barrier, out = context.Barrier(n), context.Queue()
            procs = [
                context.Process(target=engine, args=(root, packed, args.reps, barrier, out))
                for _ in range(n)
            ]
            for p in procs:
                p.start()
            results = [out.get() for _ in procs]
            for p in procs:
                p.join()
            worst = {w: max((r[w] for r in results), key=lambda t: t[0]) for w in results[0]}
            report(f"share, {n} engine(s)", worst, base)
    finally:
        spawned.process.kill()
        spawned.process.wait()
        shutil.rmtree(root)
    p50, p99 = shm_index_lookup(prefix, args.reps)
    print(
        f"  {'shm numpy index (b)':<22} {'lookup 1k':<20} p50 {p50:8.1f} us  p99 {p99:8.1f} us  "
        f"({p50 / base['lookup 1k'][0]:.2f}x private, {p50 / BUDGET_US:.2f}x budget)"
    )


if __name__ == "__main__":
    main()
