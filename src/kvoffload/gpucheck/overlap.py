"""How much the transfer worker's copies slow a running matrix product, and how fast
they go meanwhile.

The matrix product is a loop of ``torch.matmul(a, b, out=c)`` (square, ``n`` x ``n``)
on the current stream, sized to run about ``target_s`` alone, timed from a
synchronize of that stream to the next (not of the device: the copies' streams are
not waited for). The copies: :class:`Copies` holds an engine (``flash_attn`` layout,
1 MiB chunks), a page-locked slab and a
:class:`~kvoffload.transfer.worker.TransferWorker`; while :meth:`Copies.pumping` is
entered, one thread (the only one calling the worker then, as it requires on CUDA)
keeps ``depth`` store jobs and ``depth`` load jobs in flight, on the worker's own
streams, stores from one half of the engine and slab and loads into the other. That
thread submits from an idle stream of its own, so the worker's wait for "the engine's
current stream" does not queue the copies behind the matrix product (in vLLM a store
waits for the forward pass that wrote its blocks; here nothing wrote them).

Each of ``rounds`` rounds times the matmul alone, the matmul with copies, and copies
alone (as long as the matmul ran alone); the result has medians: the matmul's seconds
alone and with copies (``slowdown`` = with / alone), and the copies' GB/s (both
directions together: bytes of the jobs finished inside the window) alone and during
the matmul. Works on the CPU too (tests).
"""

from __future__ import annotations

import contextlib
import random
import statistics
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kvoffload.core.jobs import EngineJob, JobKind
from kvoffload.gpucheck.jobs import engine_job, finish, submit
from kvoffload.gpucheck.kv_layouts import KVShape, build
from kvoffload.gpucheck.report import Budget, Entry
from kvoffload.gpucheck.slabs import host_slab
from kvoffload.transfer.layout import register_kv_caches
from kvoffload.transfer.worker import TransferWorker

MiB = 1 << 20


@dataclass(frozen=True)
class OverlapConfig:
    n: int = 8192
    dtype: torch.dtype = torch.bfloat16
    target_s: float = 1.0
    rounds: int = 3
    engine_bytes: int = 512 * MiB
    job_chunks: int = 8
    depth: int = 4
    head_dim: int = 128  # with 8 heads, 16 tokens, 4 layers, 4 blocks: 1 MiB chunks


class Copies:
    """The engine, slab, worker and job plans the copies use (module doc)."""

    def __init__(self, device: torch.device, config: OverlapConfig) -> None:
        self.k = 4
        heads, tokens, layers = 8, 16, 4
        block_bytes = layers * 2 * tokens * heads * config.head_dim * 2
        num_blocks = max(4 * self.k * config.job_chunks, config.engine_bytes // block_bytes)
        shape = KVShape(
            num_blocks, tokens, torch.bfloat16, str(device), layers, heads, config.head_dim
        )
        self._kv = build("flash_attn", shape)  # the worker only views the engine's tensors
        layout = register_kv_caches(self._kv.caches, num_blocks)
        chunks = num_blocks // self.k
        self.chunk_bytes = layout.chunk_bytes(self.k)
        slab = host_slab(self.chunk_bytes, chunks, pinned=device.type == "cuda")
        self.worker = TransferWorker(layout, slab, self.k, threads=1)
        self.device = device
        self.config = config
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None  # type: ignore[no-untyped-call]
        rng = random.Random(0)
        half = chunks // 2
        self.plans = {
            JobKind.STORE: self._plan(rng, range(half), range(half * self.k)),
            JobKind.LOAD: self._plan(
                rng, range(half, 2 * half), range(half * self.k, 2 * half * self.k)
            ),
        }

    def _plan(
        self, rng: random.Random, slots: range, blocks: range
    ) -> list[tuple[list[int], list[int]]]:
        slot_list, block_list = list(slots), list(blocks)
        rng.shuffle(slot_list)
        rng.shuffle(block_list)
        m, k = self.config.job_chunks, self.k
        return [
            (slot_list[i : i + m], block_list[i * k : (i + m) * k])
            for i in range(0, len(slot_list) - m + 1, m)
        ]

    @contextlib.contextmanager
    def pumping(self) -> Iterator[Pump]:
        """Copies run from entry to exit; on exit the pump drains, and a failed copy
        raises."""
        pump = Pump(self)
        pump.start()
        try:
            yield pump
        finally:
            pump.stop()

    def close(self) -> None:
        self.worker.shutdown()


class Pump(threading.Thread):
    """The thread keeping jobs in flight; ``finished`` lists ``(time.perf_counter(),
    bytes)`` per finished job. A failure stops it and is raised by :meth:`stop`."""

    def __init__(self, copies: Copies) -> None:
        super().__init__(name="gpu-check-copies", daemon=True)
        self.copies = copies
        self.finished: list[tuple[float, int]] = []
        self.failure: BaseException | None = None
        self._stop_flag = threading.Event()

    def run(self) -> None:
        try:
            stream = self.copies.stream
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                self._pump()
        except BaseException as exc:
            self.failure = exc

    def _pump(self) -> None:
        copies, worker = self.copies, self.copies.worker
        queues: dict[JobKind, deque[EngineJob]] = {JobKind.STORE: deque(), JobKind.LOAD: deque()}
        turn = 0
        while not self._stop_flag.is_set():
            for kind, queue in queues.items():
                plans = copies.plans[kind]
                while len(queue) < copies.config.depth:
                    slots, blocks = plans[turn % len(plans)]
                    turn += 1
                    job = engine_job(kind, slots, blocks, copies.k)
                    submit(worker, job)
                    queue.append(job)
            oldest = min(queues.values(), key=lambda q: q[0].job_id).popleft()
            for result in finish(worker, [oldest]):
                self.finished.append((time.perf_counter(), result.nbytes))
        for queue in queues.values():
            finish(worker, list(queue))

    def gbps_between(self, begin: float, end: float) -> float:
        moved = sum(n for t, n in list(self.finished) if begin <= t <= end)
        return moved / max(end - begin, 1e-9) / 1e9

    def stop(self) -> None:
        self._stop_flag.set()
        self.join()
        if self.failure is not None:
            raise self.failure


def _sync(device: torch.device) -> None:
    """Wait for the current stream only (the copies' streams run on)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _matmul_seconds(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, iters: int) -> float:
    _sync(a.device)
    begin = time.perf_counter()
    for _ in range(iters):
        torch.matmul(a, b, out=c)
    _sync(a.device)
    return time.perf_counter() - begin


FILL_S = 0.05  # a pump's first jobs before a window opens


def run(device: torch.device, config: OverlapConfig, budget: Budget) -> Entry:
    """The overlap measurement (module doc); raises when a copy fails. At least one
    round runs; later ones only while the budget lasts."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(config.n, config.n, device=device, dtype=config.dtype, generator=gen)
    b = torch.randn(config.n, config.n, device=device, dtype=config.dtype, generator=gen)
    c = torch.empty_like(a)
    _matmul_seconds(a, b, c, 2)  # warm-up
    iters = max(3, round(config.target_s / (_matmul_seconds(a, b, c, 3) / 3)))
    copies = Copies(device, config)
    alone: list[float] = []
    during: list[float] = []
    copy_during: list[float] = []
    copy_alone: list[float] = []
    try:
        for r in range(config.rounds):
            if r and budget.expired():
                break
            alone.append(_matmul_seconds(a, b, c, iters))
            with copies.pumping() as pump:
                time.sleep(FILL_S)
                begin = time.perf_counter()
                during.append(_matmul_seconds(a, b, c, iters))
                copy_during.append(pump.gbps_between(begin, time.perf_counter()))
            with copies.pumping() as pump:
                time.sleep(FILL_S)
                begin = time.perf_counter()
                time.sleep(alone[-1])
                copy_alone.append(pump.gbps_between(begin, time.perf_counter()))
    finally:
        copies.close()
    alone_s, during_s = statistics.median(alone), statistics.median(during)
    flop = 2 * config.n**3 * iters
    return {
        "matmul_n": config.n,
        "matmul_dtype": str(config.dtype).removeprefix("torch."),
        "matmul_iters": iters,
        "rounds": len(alone),
        "matmul_alone_s": round(alone_s, 4),
        "matmul_with_copies_s": round(during_s, 4),
        "slowdown": round(during_s / alone_s, 3),
        "matmul_tflops_alone": round(flop / alone_s / 1e12, 3),
        "chunk_bytes": copies.chunk_bytes,
        "copy_alone_gbps": round(statistics.median(copy_alone), 3),
        "copy_during_gbps": round(statistics.median(copy_during), 3),
        "copy_depth": config.depth,
    }
