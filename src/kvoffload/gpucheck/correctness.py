"""Round trips through the transfer worker, compared bit for bit with the layout rule.

One :class:`Case` is a layout, a dtype, a block size (tokens) and a slab (``host``: a
private :class:`~kvoffload.tiers.host.HostSlab`; ``shared``: a node-shared
:class:`~kvoffload.tiers.host_shared_slab.SharedSlab`). :func:`run_case`:

1. builds fake KV caches with random bytes on the device, registers them and makes a
   :class:`~kvoffload.transfer.worker.TransferWorker` over the slab (on CUDA: its
   :class:`~kvoffload.transfer.cuda_copy.CudaCopier` and a page-locked slab, the
   shared one registered with ``cudaHostRegister``; on CPU: its CPU copier);
2. stores four chunks from random blocks of the first half of the engine into slots
   ``5, 0, 1, 7`` (runs of one and two chunks) and checks every slab row against the
   reference block record (for a shared slab, read through a second mapping of the
   same file, as another engine would);
3. loads them back into blocks of the second half with two jobs, one starting inside
   its first chunk (``skip_blocks``) and one that leaves a block out (``NO_BLOCK``),
   and checks that exactly the named blocks changed, to the stored bytes.

A case never raises: an exception is a failed case whose ``error`` says why.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from kvoffload.core.jobs import NO_BLOCK, JobKind
from kvoffload.gpucheck.jobs import engine_job, finish, submit
from kvoffload.gpucheck.kv_layouts import (
    LAYOUTS,
    KVCaches,
    KVShape,
    block_record,
    build,
    expected_after_load,
    mismatched_layers,
    snapshot,
)
from kvoffload.gpucheck.report import Budget, Entry, Report
from kvoffload.gpucheck.slabs import SharedSlabFiles, host_slab, make_share, private_root
from kvoffload.tiers.slot_rows import SlotRows
from kvoffload.transfer.layout import KVLayout, register_kv_caches
from kvoffload.transfer.worker import TransferWorker

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SLABS = ("host", "shared")
NUM_BLOCKS = 32
NUM_SLOTS = 8
STORE_SLOTS = (5, 0, 1, 7)
CHUNK_BLOCKS = (2, 4, 3)


@dataclass(frozen=True)
class Case:
    layout: str
    dtype: torch.dtype
    block_size: int
    slab: str
    blocks_per_chunk: int = 2

    def describe(self) -> Entry:
        return {
            "layout": self.layout,
            "dtype": str(self.dtype).removeprefix("torch."),
            "block_size": self.block_size,
            "blocks_per_chunk": self.blocks_per_chunk,
            "slab": self.slab,
        }


def cases(block_sizes: tuple[int, ...]) -> Iterator[Case]:
    """Every layout x dtype x block size x slab, block sizes outermost; the block
    sizes take chunks of :data:`CHUNK_BLOCKS` blocks in turn."""
    for i, block_size in enumerate(block_sizes):
        k = CHUNK_BLOCKS[i % len(CHUNK_BLOCKS)]
        for layout in LAYOUTS:
            for dtype in DTYPES:
                for slab in SLABS:
                    yield Case(layout, dtype, block_size, slab, k)


def run_all(
    report: Report, device: torch.device, block_sizes: tuple[int, ...], budget: Budget
) -> None:
    """Run every case of :func:`cases` on ``device`` into ``report.correctness``;
    cases past the budget are listed in ``report.skipped``."""
    todo = list(cases(block_sizes))
    with private_root(64 << 20) as root:
        for index, case in enumerate(todo):
            if budget.expired():
                report.skip(
                    f"correctness:{device.type}", f"time budget: {len(todo) - index} cases left"
                )
                break
            entry = run_case(case, device, root, name=f"check{index}")
            report.correctness.append(entry)
            if not entry["ok"]:
                report.say(f"FAILED correctness {entry}")
    ran = [e for e in report.correctness if e["device"] == device.type]
    good = sum(e["ok"] for e in ran)
    report.say(f"correctness on {device.type}: {good}/{len(ran)} cases bit-exact")


def run_case(case: Case, device: torch.device, root: Path, *, name: str) -> Entry:
    """One round trip (module docstring); the entry says what ran and whether it
    matched. Never raises."""
    entry: Entry = {**case.describe(), "device": device.type, "pinned": False, "bytes": 0}
    try:
        entry.update(_round_trip(case, device, root, name))
        entry["ok"], entry["error"] = True, None
    except Exception as exc:
        entry["ok"], entry["error"] = False, f"{type(exc).__name__}: {exc}"
    return entry


def _round_trip(case: Case, device: torch.device, root: Path, name: str) -> Entry:
    shape = KVShape(NUM_BLOCKS, case.block_size, case.dtype, str(device), heads=2, head_dim=32)
    kv = build(case.layout, shape, seed=random.Random(name).randrange(1 << 31))
    layout = register_kv_caches(kv.caches, kv.num_blocks)
    k = case.blocks_per_chunk
    share = (
        make_share(root, name, layout.chunk_bytes(k), NUM_SLOTS) if case.slab == "shared" else None
    )
    try:
        return _copy_and_compare(kv, layout, share, k, name)
    finally:
        if share is not None:
            share.remove()


def _copy_and_compare(
    kv: KVCaches, layout: KVLayout, share: SharedSlabFiles | None, k: int, name: str
) -> Entry:
    """Steps 2 and 3 of the module docstring, over ``share``'s slab (None: a private
    one); what ran. Raises on any difference."""
    pinned = layout.device.type == "cuda"
    chunk_bytes = layout.chunk_bytes(k)
    slab: SlotRows = (
        share.open(pinned=pinned)
        if share is not None
        else host_slab(chunk_bytes, NUM_SLOTS, pinned=pinned)
    )
    worker = TransferWorker(layout, slab, k, threads=1)
    try:
        rng = random.Random(name)
        half = kv.num_blocks // 2
        sources = rng.sample(range(half), len(STORE_SLOTS) * k)
        store = engine_job(JobKind.STORE, STORE_SLOTS, sources, k)
        submit(worker, store)
        stored = sum(r.nbytes for r in finish(worker, [store]))
        reader = share.open(pinned=False) if share is not None else slab
        _check_rows(kv, reader, dict(zip(STORE_SLOTS, _chunks(sources, k), strict=True)), k)
        loaded, moves = _load_back(
            worker, kv, sources, rng.sample(range(half, kv.num_blocks), half), k
        )
        if stored + loaded != (len(sources) + len(moves)) * layout.block_bytes:
            raise AssertionError(f"results count {stored + loaded} bytes, expected more")
        return {"pinned": slab.pinned, "bytes": stored + loaded, "moves": len(sources) + len(moves)}
    finally:
        worker.shutdown()
        close = getattr(slab, "close", None)
        if close is not None:
            close()


def _chunks(blocks: list[int], k: int) -> list[list[int]]:
    return [blocks[i : i + k] for i in range(0, len(blocks), k)]


def _check_rows(kv: KVCaches, slab: SlotRows, chunks: dict[int, list[int]], k: int) -> None:
    """Every stored slab row holds its block's reference record."""
    size = slab.chunk_bytes // k
    for slot, blocks in chunks.items():
        row = bytes(slab.slot_bytes(slot))
        for j, block in enumerate(blocks):
            if row[j * size : (j + 1) * size] != block_record(kv, block):
                raise AssertionError(f"slot {slot} row {j}: not the record of block {block}")


def _load_back(
    worker: TransferWorker, kv: KVCaches, sources: list[int], targets: list[int], k: int
) -> tuple[int, list[tuple[int, int]]]:
    """Load slots 7, 1 (skipping one block) and 5, 0 (one block left out) into
    ``targets``; check the engine; bytes loaded and the ``(source, target)`` moves."""
    chunks = dict(zip(STORE_SLOTS, _chunks(sources, k), strict=True))
    first = [b for s in (7, 1) for b in chunks[s]][1:]  # skip_blocks=1
    second = [b for s in (5, 0) for b in chunks[s]]
    moves = list(zip(first, targets, strict=False))
    into_first = targets[: len(first)]
    rest = targets[len(first) :]
    into_second = [NO_BLOCK if i == 1 else rest[i] for i in range(len(second))]
    moves += [(src, dst) for src, dst in zip(second, into_second, strict=True) if dst != NO_BLOCK]
    before = snapshot(kv)
    jobs = [
        engine_job(JobKind.LOAD, (7, 1), into_first, k, skip=1),
        engine_job(JobKind.LOAD, (5, 0), into_second, k),
    ]
    for job in jobs:
        submit(worker, job)
    loaded = sum(r.nbytes for r in finish(worker, jobs))
    bad = mismatched_layers(kv, expected_after_load(kv, before, moves))
    if bad:
        raise AssertionError(f"after the loads, layers {bad} differ from the expected bytes")
    return loaded, moves
