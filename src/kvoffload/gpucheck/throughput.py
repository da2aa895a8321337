"""The transfer worker's copy throughput against plain ``copy_(non_blocking=True)``.

For each chunk size a :class:`Bench` holds a ``flash_attn``-layout engine (4 layers,
K and V pages, blocks of 16 tokens, ``BLOCKS_PER_CHUNK`` blocks per chunk, the pages
sized so that a chunk has the chunk size) and a page-locked
:class:`~kvoffload.tiers.host.HostSlab` twice the bytes moved. One round moves
``round_bytes`` in each direction, as:

- ``kvoffload``: store (or load) jobs of about ``job_bytes`` through the
  :class:`~kvoffload.transfer.worker.TransferWorker`, every chunk to a random even
  slot (no two chunks of a job adjacent: one device-host copy per chunk), from (or to)
  random engine blocks; all submitted, then waited for;
- ``baseline``: one ``copy_(non_blocking=True)`` per chunk between a device tensor and
  the same slab rows, on the current stream, then a synchronize;
- ``whole``: one ``copy_`` of all the round's bytes (the link's peak).

Rounds alternate the order of the methods; the entry has the median GB/s of each and
``ratio`` = kvoffload / baseline. Works on the CPU too (tests), where both are copies
in host memory. Memory: about 2x ``round_bytes`` of device memory and 2x of pinned host
memory per chunk size, freed before the next one.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvoffload.core.jobs import EngineJob, JobKind
from kvoffload.gpucheck.jobs import engine_job, finish, submit, synchronize
from kvoffload.gpucheck.kv_layouts import KVShape, build
from kvoffload.gpucheck.report import Budget, Entry, Report
from kvoffload.gpucheck.slabs import host_slab
from kvoffload.transfer.layout import register_kv_caches
from kvoffload.transfer.worker import TransferWorker

KiB = 1 << 10
MiB = 1 << 20
CHUNK_SIZES = (16 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 2 * MiB)
DIRECTIONS = ("store", "load")
BLOCKS_PER_CHUNK = 4
LAYERS = 4
BLOCK_TOKENS = 16


@dataclass(frozen=True)
class ThroughputConfig:
    round_bytes: int = 128 * MiB
    rounds: int = 5
    job_bytes: int = 8 * MiB
    chunk_sizes: tuple[int, ...] = CHUNK_SIZES


class Bench:
    """One chunk size's engine, slab, worker, jobs and baseline tensors (module doc)."""

    def __init__(self, device: torch.device, chunk_bytes: int, config: ThroughputConfig) -> None:
        k = BLOCKS_PER_CHUNK
        page = chunk_bytes // (k * LAYERS * 2)
        dtype = torch.bfloat16
        head_dim = page // (BLOCK_TOKENS * dtype.itemsize)
        self.chunks = max(1, config.round_bytes // chunk_bytes)
        shape = KVShape(self.chunks * k, BLOCK_TOKENS, dtype, str(device), LAYERS, 1, head_dim)
        self.kv = build("flash_attn", shape)
        layout = register_kv_caches(self.kv.caches, self.kv.num_blocks)
        if layout.chunk_bytes(k) != chunk_bytes:
            raise ValueError(f"chunk of {chunk_bytes} B: not {k} blocks of this layout")
        self.device = device
        self.nbytes = self.chunks * chunk_bytes
        self.slab = host_slab(chunk_bytes, 2 * self.chunks, pinned=device.type == "cuda")
        self.worker = TransferWorker(layout, self.slab, k, threads=1)
        rng = random.Random(chunk_bytes)
        self.rows = [2 * c for c in rng.sample(range(self.chunks), self.chunks)]
        per_job = max(1, config.job_bytes // chunk_bytes)
        self.jobs: dict[str, list[tuple[list[int], list[int]]]] = {}
        for direction in DIRECTIONS:
            blocks = rng.sample(range(self.kv.num_blocks), self.kv.num_blocks)
            self.jobs[direction] = [
                (self.rows[c : c + per_job], blocks[c * k : (c + per_job) * k])
                for c in range(0, self.chunks, per_job)
            ]
        self.staging = torch.empty((self.chunks, chunk_bytes), dtype=torch.uint8, device=device)
        self.slots = self.slab.data

    def run(self, method: str, direction: str) -> float:
        """Seconds one round of ``method`` took in ``direction`` (all work finished)."""
        timed: dict[str, Callable[[str], None]] = {
            "kvoffload": self._kvoffload,
            "baseline": self._baseline,
            "whole": self._whole,
        }
        synchronize(self.device)
        begin = time.perf_counter()
        timed[method](direction)
        synchronize(self.device)
        return time.perf_counter() - begin

    def _kvoffload(self, direction: str) -> None:
        kind = JobKind.STORE if direction == "store" else JobKind.LOAD
        jobs: list[EngineJob] = []
        for slots, blocks in self.jobs[direction]:
            job = engine_job(kind, slots, blocks, BLOCKS_PER_CHUNK)
            submit(self.worker, job)
            jobs.append(job)
        moved = sum(r.nbytes for r in finish(self.worker, jobs))
        if moved != self.nbytes:
            raise AssertionError(f"kvoffload moved {moved} B, expected {self.nbytes}")

    def _baseline(self, direction: str) -> None:
        device, host = self.staging, self.slots
        if direction == "store":
            for c, row in enumerate(self.rows):
                host[row].copy_(device[c], non_blocking=True)
        else:
            for c, row in enumerate(self.rows):
                device[c].copy_(host[row], non_blocking=True)

    def _whole(self, direction: str) -> None:
        device = self.staging.view(-1)
        host = self.slots.view(-1)[: device.numel()]
        if direction == "store":
            host.copy_(device, non_blocking=True)
        else:
            device.copy_(host, non_blocking=True)

    def close(self) -> None:
        self.worker.shutdown()


METHODS = ("kvoffload", "baseline", "whole")


def measure(bench: Bench, direction: str, rounds: int, budget: Budget) -> Entry:
    """Medians over ``rounds`` interleaved rounds (fewer when the budget runs out;
    at least one) of every method in ``direction``."""
    for method in METHODS:  # warm-up: allocator, kernels, first touch
        bench.run(method, direction)
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for r in range(rounds):
        if r and budget.expired():
            break
        for i in range(len(METHODS)):
            method = METHODS[(r + i) % len(METHODS)]
            times[method].append(bench.run(method, direction))
    gbps = {m: bench.nbytes / statistics.median(t) / 1e9 for m, t in times.items()}
    return {
        "direction": direction,
        "chunk_bytes": bench.nbytes // bench.chunks,
        "bytes_per_round": bench.nbytes,
        "rounds": len(times["kvoffload"]),
        "kvoffload_gbps": round(gbps["kvoffload"], 3),
        "baseline_gbps": round(gbps["baseline"], 3),
        "whole_gbps": round(gbps["whole"], 3),
        "ratio": round(gbps["kvoffload"] / gbps["baseline"], 3),
    }


def run_all(report: Report, device: torch.device, config: ThroughputConfig, budget: Budget) -> None:
    """Measure every chunk size and direction into ``report.throughput``; what the
    budget leaves out is listed in ``report.skipped``, a size that raises in
    ``report.errors``."""
    for index, size in enumerate(config.chunk_sizes):
        if budget.expired():
            left = ", ".join(f"{s // KiB} KiB" for s in config.chunk_sizes[index:])
            report.skip("throughput", f"time budget: chunk sizes {left} not measured")
            return
        bench: Bench | None = None
        try:
            bench = Bench(device, size, config)
            for direction in DIRECTIONS:
                entry = measure(bench, direction, config.rounds, budget)
                report.throughput.append(entry)
                report.say(
                    f"throughput {direction} {size // KiB:5d} KiB chunks: kvoffload "
                    f"{entry['kvoffload_gbps']:.2f} GB/s, copy_ {entry['baseline_gbps']:.2f} "
                    f"GB/s (ratio {entry['ratio']:.2f}), one copy {entry['whole_gbps']:.2f} GB/s"
                )
        except Exception as exc:
            report.error(f"throughput {size // KiB} KiB", exc)
        finally:
            if bench is not None:
                bench.close()
            del bench
            if device.type == "cuda":
                torch.cuda.empty_cache()
