"""Byte-exact stores and loads, for every layout, chunk size and copy path."""

from __future__ import annotations

import random

import pytest
import torch
from kv_engines import ENGINES, Engine, job, record, snapshot

from kvoffload.core.jobs import JobKind
from kvoffload.tiers.host import HostSlab
from kvoffload.transfer import TransferWorker, register_kv_caches
from kvoffload.transfer.cpu_copy import CpuCopier
from kvoffload.transfer.plan import plan_job

NUM_BLOCKS = 40
SLOTS = 12

# Every way a job is split between copy threads.
PATHS = {  # copy threads, split_bytes
    "one-thread": (1, 1 << 20),
    "two-threads-split-every-job": (2, 1),
    "three-threads-split-every-job": (3, 1),
}


def slab_bytes(slab: HostSlab, slot: int) -> bytes:
    return bytes(slab.slot_bytes(slot))


class Harness:
    """One engine, one slab, and a synchronous way to run a job through a copier."""

    def __init__(self, engine: Engine, k: int, path: str) -> None:
        self.engine, self.k = engine, k
        self.layout = register_kv_caches(engine.caches, engine.num_blocks)
        self.slab = HostSlab(self.layout.chunk_bytes(k), self.layout.chunk_bytes(k) * SLOTS)
        threads, split = PATHS[path]
        self.copier = CpuCopier(self.layout, self.slab, k, threads=threads, split_bytes=split)
        self.next_id = 0

    def run(self, kind: JobKind, slots: list[int], blocks: list[int], skip: int = 0) -> None:
        self.next_id += 1
        plan = plan_job(
            job(self.next_id, kind, slots, blocks, self.k, skip=skip),
            kind,
            num_blocks=self.engine.num_blocks,
            num_slots=self.slab.num_slots,
            blocks_per_chunk=self.k,
            block_bytes=self.layout.block_bytes,
        )
        (self.copier.store if kind is JobKind.STORE else self.copier.load)(plan)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("layout", sorted(ENGINES))
def test_store_then_load_is_byte_exact(layout: str, k: int, path: str) -> None:
    rng = random.Random(f"{layout}-{k}-{path}")
    h = Harness(ENGINES[layout](NUM_BLOCKS), k, path)
    rec = h.layout.block_bytes
    # Store 5 chunks from shuffled blocks into out-of-order slots (some consecutive).
    slots = [7, 2, 3, 11, 0]
    blocks = rng.sample(range(NUM_BLOCKS), 5 * k)
    before = {s: slab_bytes(h.slab, s) for s in range(SLOTS)}
    h.run(JobKind.STORE, slots, blocks)
    for i, slot in enumerate(slots):
        expected = b"".join(record(h.engine, b) for b in blocks[i * k : (i + 1) * k])
        assert slab_bytes(h.slab, slot) == expected
    for slot in set(range(SLOTS)) - set(slots):
        assert slab_bytes(h.slab, slot) == before[slot], "a slot not in the job changed"
    # Load the chunks back into other blocks, skipping part of the first chunk.
    skip = k - 1
    targets = rng.sample(range(NUM_BLOCKS), 5 * k - skip)
    engine_before = snapshot(h.engine)
    expected_records = {}
    for m, block in enumerate(targets):
        slot, j = slots[(m + skip) // k], (m + skip) % k
        expected_records[block] = slab_bytes(h.slab, slot)[j * rec : (j + 1) * rec]
    h.run(JobKind.LOAD, slots, targets, skip)
    for block in range(NUM_BLOCKS):
        if block in expected_records:
            assert record(h.engine, block) == expected_records[block]
    _assert_only_blocks_changed(h.engine, engine_before, set(targets))
    h.copier.close()


def _assert_only_blocks_changed(
    engine: Engine, before: dict[str, torch.Tensor], changed: set[int]
) -> None:
    for name, t in engine.caches.items():
        now, old = t.view(torch.uint8), before[name]
        bdim = engine.block_dims[name]
        for block in set(range(engine.num_blocks)) - changed:
            assert torch.equal(now.select(bdim, block), old.select(bdim, block)), (name, block)


@pytest.mark.parametrize("layout", sorted(ENGINES))
def test_worker_round_trip_with_partial_first_chunk(layout: str) -> None:
    engine = ENGINES[layout](NUM_BLOCKS)
    k = 4
    worker = TransferWorker.for_kv_caches(
        engine.caches,
        NUM_BLOCKS,
        blocks_per_chunk=k,
        host_budget_bytes=SLOTS * k * register_kv_caches(engine.caches, NUM_BLOCKS).block_bytes,
    )
    blocks = list(range(NUM_BLOCKS - 1, NUM_BLOCKS - 1 - 3 * k, -1))
    originals = {b: record(engine, b) for b in blocks}
    worker.submit_store(job(1, JobKind.STORE, [5, 9, 1], blocks, k))
    worker.wait([1])
    assert [(r.job_id, r.success, r.nbytes) for r in worker.poll()] == [
        (1, True, 3 * k * worker.layout.block_bytes)
    ]
    before = snapshot(engine)
    targets = [0, 3, 6, 9, 12, 15, 18, 21, 24, 27]  # skip 2: chunk 0 gives its last two
    worker.submit_load(job(2, JobKind.LOAD, [5, 9, 1], targets, k, skip=2))
    worker.wait([2])
    assert [(r.job_id, r.success) for r in worker.poll()] == [(2, True)]
    for target, source in zip(targets, blocks[2:], strict=True):
        assert record(engine, target) == originals[source]
    _assert_only_blocks_changed(engine, before, set(targets))
    worker.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_round_trip() -> None:
    caches = {f"l{i}": torch.randn(2, 16, 4, 2, 8, device="cuda") for i in range(2)}
    worker = TransferWorker.for_kv_caches(caches, 16, blocks_per_chunk=2, host_budget_bytes=1 << 20)
    original = {name: t.clone() for name, t in caches.items()}
    worker.submit_store(job(1, JobKind.STORE, [3, 0], [5, 1, 7, 2], 2))
    worker.wait([1])
    worker.submit_load(job(2, JobKind.LOAD, [3, 0], [9, 10, 11], 2, skip=1))
    worker.wait([2])
    assert all(r.success for r in worker.poll())
    for name, t in caches.items():
        assert torch.equal(t[:, [9, 10, 11]], original[name][:, [1, 7, 2]])
    worker.shutdown()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_fp8_round_trip_is_within_the_bound() -> None:
    """fp8 encoded on the GPU before the copy to host, decoded after it (issue 33)."""
    from kvoffload.codecs import fp8

    caches = {f"l{i}": torch.randn(2, 16, 4, 2, 8, device="cuda") for i in range(2)}
    worker = TransferWorker.for_kv_caches(
        caches, 16, blocks_per_chunk=2, host_budget_bytes=1 << 20, codec="fp8"
    )
    original = {name: t.clone() for name, t in caches.items()}
    worker.submit_store(job(1, JobKind.STORE, [3, 0], [5, 1, 7, 2], 2))
    worker.wait([1])
    worker.submit_load(job(2, JobKind.LOAD, [3, 0], [9, 10, 11], 2, skip=1))
    worker.wait([2])
    assert all(r.success for r in worker.poll())
    for name, t in caches.items():
        got, want = t[:, [9, 10, 11]].cpu(), original[name][:, [1, 7, 2]].cpu()
        assert fp8.within_bound(want.reshape(-1), got.reshape(-1), 64)
        assert not torch.equal(got, want)  # really through fp8
    worker.shutdown()
