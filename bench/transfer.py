"""Store and load throughput of the transfer worker against memcpy, in one run.

    .venv/bin/python bench/transfer.py [--reps 5] [--move-mib 256] [--engine-mib 1024]

Engines, both in vLLM's CPU layout (per layer ``[num_blocks, heads, 32, 2 * head]``,
all layers views of one shared storage):

- ``tiny``: the test model, 2 layers of 8 KiB pages (bf16, 1 KV head): 16 KiB per
  block. Chunks of 1, 16 and 128 blocks (16 KiB, 256 KiB, 2 MiB): the worst case,
  every page is small.
- ``64KiB-pages``: 4 layers of 64 KiB pages (fp32, 4 KV heads of 64, the demo
  model's page): 256 KiB per block. Chunks of 1 and 8 blocks (256 KiB, 2 MiB).

With 1 and 2 copy threads. Each repetition stores ``--move-mib`` of chunks (jobs of about
4 MiB) from random engine blocks into host slots, then loads them into other random
blocks, through :class:`TransferWorker` (submit every job, then wait for all). Slot
patterns: ``random`` (a fragmented directory) and ``sequential`` (a fresh one). The
cases run interleaved, in a rotating order, so that drift in the machine's memory
bandwidth (large here: memcpy varies 11-15 GB/s) hits them all alike.

References measured in the same run: ``memcpy`` is ``np.copyto`` of 1 GiB into a
pre-faulted destination (glibc uses non-temporal stores at that size); ``pieces`` is
the same copy in 256 KiB pieces (ordinary stores, as for any page-sized copy).
Throughput counts bytes copied once. Prints medians and ratios to memcpy.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvoffload.core.jobs import EngineJob, JobKind
from kvoffload.core.keys import ChunkKey
from kvoffload.tiers.host import HostSlab
from kvoffload.transfer import TransferWorker, register_kv_caches

GiB = 1 << 30
# name: (layers, kv heads, block tokens, 2 * head size, dtype)
ENGINES = {
    "tiny": (2, 1, 32, 128, torch.bfloat16),
    "64KiB-pages": (4, 4, 32, 128, torch.float32),
}
CHUNK_BLOCKS = {"tiny": (1, 16, 128), "64KiB-pages": (1, 8)}
JOB_BYTES = 4 << 20
KEY = ChunkKey(bytes(16))
JOB_IDS = itertools.count()


def median_seconds(fn: Callable[[], None], reps: int) -> float:
    times = []
    for _ in range(reps):
        begin = time.perf_counter()
        fn()
        times.append(time.perf_counter() - begin)
    return statistics.median(times)


def memcpy_references(src: np.ndarray, dst: np.ndarray) -> tuple[float, float]:
    """GB/s of one whole ``np.copyto(dst, src)``, and of the same in 256 KiB pieces."""
    whole = src.nbytes / median_seconds(lambda: np.copyto(dst, src), 1) / 1e9
    piece = 256 << 10
    src2, dst2 = src.reshape(-1, 2, piece)[:, 0], dst.reshape(-1, 2, piece)[:, 0]
    pieces = src2.nbytes / median_seconds(lambda: np.copyto(dst2, src2), 1) / 1e9
    return whole, pieces


def engine(name: str, engine_bytes: int) -> tuple[dict[str, torch.Tensor], int]:
    """vLLM-CPU-style KV caches: per-layer views of one shared storage."""
    layers, heads, block, head2, dtype = ENGINES[name]
    page = heads * block * head2 * dtype.itemsize
    num_blocks = engine_bytes // (layers * page)
    raw = torch.empty(layers * num_blocks * page // 2, dtype=torch.int16)
    raw.random_()
    per_layer = num_blocks * page // 2
    caches = {
        f"layer{i}": raw[i * per_layer : (i + 1) * per_layer]
        .view(dtype)
        .view(num_blocks, heads, block, head2)
        for i in range(layers)
    }
    return caches, num_blocks


def make_jobs(
    kind: JobKind, slots: np.ndarray, blocks: np.ndarray, k: int, block_bytes: int
) -> list[EngineJob]:
    """Jobs of about ``JOB_BYTES`` moving chunk ``i`` between ``slots[i]`` and blocks."""
    per_job = max(1, JOB_BYTES // (k * block_bytes))
    jobs = []
    for start in range(0, len(slots), per_job):
        chunk_slots = tuple(int(s) for s in slots[start : start + per_job])
        chunk_blocks = tuple(int(b) for b in blocks[start * k : (start + len(chunk_slots)) * k])
        keys = (KEY,) * len(chunk_slots)
        jobs.append(EngineJob(next(JOB_IDS), kind, "bench", keys, chunk_slots, chunk_blocks, k))
    return jobs


@dataclass
class Case:
    """One table row: a worker over one slab, and its measured GB/s per direction."""

    engine: str
    k: int
    pattern: str
    threads: int
    worker: TransferWorker
    gbps: dict[JobKind, list[float]] = field(default_factory=lambda: {k: [] for k in JobKind})


def run_phase(case: Case, kind: JobKind, move_bytes: int, rng: np.random.Generator) -> float:
    """Move ``move_bytes`` of chunks in one direction; GB/s from first submit to last."""
    worker, k = case.worker, case.k
    num_slots, num_blocks = worker.slab.num_slots, worker.layout.num_blocks
    chunks = move_bytes // worker.slab.chunk_bytes
    if case.pattern == "random":
        slots = rng.permutation(num_slots)[:chunks]
    else:
        slots = np.arange(chunks) + int(rng.integers(0, num_slots - chunks + 1))
    blocks = rng.permutation(num_blocks)[: chunks * k]
    jobs = make_jobs(kind, slots, blocks, k, worker.layout.block_bytes)
    submit = worker.submit_store if kind is JobKind.STORE else worker.submit_load
    begin = time.perf_counter()
    for job in jobs:
        submit(job)
    worker.wait(job.job_id for job in jobs)
    elapsed = time.perf_counter() - begin
    results = worker.poll()
    assert all(r.success for r in results), [r.error for r in results if not r.success]
    return sum(r.nbytes for r in results) / elapsed / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--move-mib", type=int, default=256, help="MiB moved per phase")
    parser.add_argument("--engine-mib", type=int, default=1024, help="engine KV size")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    move = args.move_mib << 20
    cases = []
    for name in ENGINES:
        caches, num_blocks = engine(name, args.engine_mib << 20)
        layout = register_kv_caches(caches, num_blocks)
        for k in CHUNK_BLOCKS[name]:
            slab = HostSlab(layout.chunk_bytes(k), 2 * move)
            for pattern in ("random", "sequential"):
                for threads in (1, 2):
                    worker = TransferWorker(layout, slab, k, threads=threads)
                    cases.append(Case(name, k, pattern, threads, worker))
    src, dst = np.ones(GiB, np.uint8), np.empty(GiB, np.uint8)
    dst.fill(0)  # pre-fault
    memcpy: list[float] = []
    pieces: list[float] = []
    for rep in range(args.reps + 1):  # repetition 0 warms up
        whole, piece = memcpy_references(src, dst)
        order = cases[rep % len(cases) :] + cases[: rep % len(cases)]  # rotate against drift
        for case in order:
            for kind in (JobKind.STORE, JobKind.LOAD):
                gbps = run_phase(case, kind, move, rng)
                if rep:
                    case.gbps[kind].append(gbps)
        if rep:
            memcpy.append(whole)
            pieces.append(piece)
    mem = statistics.median(memcpy)
    print(f"memcpy (np.copyto 1 GiB, pre-faulted): {mem:5.2f} GB/s")
    piece = statistics.median(pieces)
    print(f"pieces (np.copyto, 256 KiB pieces):    {piece:5.2f} GB/s = {piece / mem:.2f}x memcpy")
    print(
        f"engines: vLLM CPU layout, {args.engine_mib} MiB each; {args.move_mib} MiB per phase "
        f"in ~4 MiB jobs; median of {args.reps} reps\n"
    )
    header = (
        f"{'engine':>12} {'chunk':>8} {'k':>4} {'slots':>10} {'thr':>3} | "
        f"{'store GB/s':>10} {'x':>5} | "
    )
    print(header + f"{'load GB/s':>10} {'x':>5}")
    print("-" * (len(header) + 17))
    for case in cases:
        store = statistics.median(case.gbps[JobKind.STORE])
        load = statistics.median(case.gbps[JobKind.LOAD])
        chunk = case.worker.slab.chunk_bytes
        print(
            f"{case.engine:>12} {chunk >> 10:>5}KiB {case.k:>4} {case.pattern:>10} "
            f"{case.threads:>3} | "
            f"{store:>10.2f} {store / mem:>5.2f} | {load:>10.2f} {load / mem:>5.2f}"
        )
    for case in cases:
        case.worker.shutdown()


if __name__ == "__main__":
    main()
