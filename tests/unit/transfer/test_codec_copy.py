"""Stores and loads through the fp8 codec (``transfer/codec_copy.py``): what comes back
is within e4m3's bound of what was stored, block for block; a load that names part
of a chunk writes only those blocks; a value that cannot be encoded fails the store with the
slot untouched; the host slab's slots are the encoded size; the worker refuses fp8
for KV it cannot encode."""

from __future__ import annotations

import pytest
import torch
from kv_engines import Engine, gpu_style, job, record, vllm_cpu

from kvoffload.codecs import fp8
from kvoffload.codecs.chunk_codec import Fp8Chunks, fp8_run
from kvoffload.core.errors import ConfigError
from kvoffload.core.jobs import JobKind
from kvoffload.tiers.host import HostSlab
from kvoffload.transfer import TransferWorker, register_kv_caches
from kvoffload.transfer.codec_copy import CodecCopier
from kvoffload.transfer.plan import plan_job

NUM_BLOCKS = 24
SLOTS = 6
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def finite(engine: Engine, seed: int) -> Engine:
    """The engine's KV filled with finite values over four decades."""
    g = torch.Generator().manual_seed(seed)
    for t in engine.caches.values():
        values = torch.randn(t.shape, generator=g) * 10 ** torch.randint(
            -2, 2, t.shape, generator=g
        )
        t.copy_(values.to(t.dtype))
    return engine


class Rig:
    def __init__(self, engine: Engine, k: int) -> None:
        self.engine, self.k = engine, k
        self.layout = register_kv_caches(engine.caches, engine.num_blocks)
        dtype = next(iter(engine.caches.values())).dtype
        self.codec = Fp8Chunks(dtype, self.layout.chunk_bytes(k))
        self.slab = HostSlab(self.codec.stored_bytes, self.codec.stored_bytes * SLOTS)
        self.copier = CodecCopier(self.layout, self.slab, k, self.codec, threads=1)
        self.dtype = dtype
        self.ids = 0

    def run(self, kind: JobKind, slots: list[int], blocks: list[int], skip: int = 0) -> None:
        self.ids += 1
        plan = plan_job(
            job(self.ids, kind, slots, blocks, self.k, skip=skip), kind,
            num_blocks=self.engine.num_blocks, num_slots=self.slab.num_slots,
            blocks_per_chunk=self.k, block_bytes=self.layout.block_bytes,
        )  # fmt: skip
        (self.copier.store if kind is JobKind.STORE else self.copier.load)(plan)

    def values(self, blocks: list[int]) -> torch.Tensor:
        data = b"".join(record(self.engine, b) for b in blocks)
        return torch.frombuffer(bytearray(data), dtype=self.dtype)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_stored_chunk_loads_back_within_the_bound(dtype: torch.dtype, k: int) -> None:
    rig = Rig(finite(vllm_cpu(NUM_BLOCKS, dtype=dtype), seed=k), k)
    elements = rig.codec.elements
    assert rig.slab.chunk_bytes == 8 + elements + 4 * (elements // fp8_run(elements))
    assert rig.layout.chunk_bytes(k) / rig.slab.chunk_bytes > 0.95 * dtype.itemsize
    src = list(range(2 * k))
    before = rig.values(src)
    rig.run(JobKind.STORE, [3, 1], src)
    dst = list(range(10, 10 + 2 * k))
    rig.run(JobKind.LOAD, [3, 1], dst)
    after = rig.values(dst)
    run = fp8_run(rig.codec.elements)
    for chunk in range(2):  # the bound holds per chunk (its runs' scales)
        n = rig.codec.elements
        a, b = before[chunk * n : (chunk + 1) * n], after[chunk * n : (chunk + 1) * n]
        assert fp8.within_bound(a, b, run)
    assert not torch.equal(before, after) or dtype is torch.float32  # lossy, really


def test_a_partial_load_writes_only_the_blocks_it_names() -> None:
    rig = Rig(finite(vllm_cpu(NUM_BLOCKS, dtype=torch.bfloat16), seed=3), 2)
    rig.run(JobKind.STORE, [0], [4, 5])
    untouched = rig.values([20])
    rig.run(JobKind.LOAD, [0], [21], skip=1)  # the chunk's second block only
    assert torch.equal(rig.values([20]), untouched)
    full = rig.values([4, 5])
    got = torch.cat([full[: len(full) // 2], rig.values([21])])
    assert fp8.within_bound(full, got, fp8_run(rig.codec.elements))


def test_a_value_that_cannot_be_encoded_fails_the_store_and_writes_nothing() -> None:
    rig = Rig(finite(vllm_cpu(NUM_BLOCKS, dtype=torch.float16), seed=4), 1)
    rig.run(JobKind.STORE, [2], [1])
    before = bytes(rig.slab.slot_bytes(2))
    name = next(iter(rig.engine.caches))
    rig.engine.caches[name][7].view(-1)[5] = float("inf")
    with pytest.raises(ValueError, match="not finite"):
        rig.run(JobKind.STORE, [2], [7])
    assert bytes(rig.slab.slot_bytes(2)) == before


def test_the_worker_sizes_its_slab_by_the_codec_and_refuses_what_it_cannot_encode() -> None:
    engine = finite(gpu_style(NUM_BLOCKS, dtype=torch.float32), seed=5)
    raw = register_kv_caches(engine.caches, NUM_BLOCKS).chunk_bytes(2)
    worker = TransferWorker.for_kv_caches(
        engine.caches, NUM_BLOCKS, blocks_per_chunk=2, host_budget_bytes=4 * raw, codec="fp8"
    )
    try:
        assert worker.slab.chunk_bytes == Fp8Chunks(torch.float32, raw).stored_bytes
        assert worker.slab.num_slots >= 15  # 4 raw chunks' bytes hold about 16 encoded
    finally:
        worker.shutdown()
    ints = {"a": torch.zeros(NUM_BLOCKS, 64, dtype=torch.int16)}
    with pytest.raises(ConfigError, match="fp8"):
        TransferWorker.for_kv_caches(
            ints, NUM_BLOCKS, blocks_per_chunk=1, host_budget_bytes=1 << 16, codec="fp8"
        )
