"""Every codec frame carries a checksum, checked before it is decoded (issue 41,
``codecs/frame_check.py``): a single flipped bit anywhere in a lossless slot's used
bytes or an fp8 chunk fails its decode (every bit of a deterministic sample), the raw
chunk is left untouched, and a load through the worker of a slot that changed fails
that job (the engine recomputes) while a load of a good slot succeeds."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from kv_engines import job, record, vllm_cpu

from kvoffload.codecs import lossless
from kvoffload.codecs.chunk_codec import ChunkCodec, Fp8Chunks, LosslessChunks
from kvoffload.codecs.frame_check import CorruptChunk
from kvoffload.core.jobs import EngineJob, JobKind, JobResult
from kvoffload.transfer import TransferWorker

RAW = 1 << 14
SAMPLED_BITS = 1500


def kv(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A raw chunk (uint8) of ``dtype`` values like KV."""
    g = torch.Generator().manual_seed(seed)
    values = (torch.randn(RAW // dtype.itemsize, generator=g) * 0.3).to(dtype)
    return values.view(torch.uint8).clone()


def flipped(slot: torch.Tensor, bit: int) -> torch.Tensor:
    bad = slot.clone()
    bad[bit // 8] ^= 1 << (bit % 8)
    return bad


def sampled_bits(used_bytes: int, seed: int) -> list[int]:
    """Every bit of the first 16 bytes (the headers) and a sample of the rest."""
    rest = random.Random(seed).sample(range(128, 8 * used_bytes), SAMPLED_BITS)
    return [*range(128), *rest]


def encoded(codec: ChunkCodec, raw: torch.Tensor) -> torch.Tensor:
    slot = torch.zeros(codec.stored_bytes, dtype=torch.uint8)
    codec.encode(raw, slot)
    return slot


def assert_every_flip_fails(codec: ChunkCodec, slot: torch.Tensor, bits: list[int]) -> None:
    out = torch.full((RAW,), 0x5A, dtype=torch.uint8)
    for bit in bits:
        with pytest.raises(CorruptChunk):
            codec.decode(flipped(slot, bit), out)
    assert bool((out == 0x5A).all())  # nothing decoded into the raw chunk


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_every_sampled_bit_flip_of_a_lossless_frame_fails_its_decode(dtype: torch.dtype) -> None:
    codec = LosslessChunks(dtype.itemsize, RAW)
    raw = kv(dtype)
    slot = encoded(codec, raw)
    used = codec.used_bytes(slot.numpy().data)
    bits = sampled_bits(used, seed=41)
    assert_every_flip_fails(codec, slot, bits)
    # What the checksum adds: blosc2 alone decodes most flips of its frame to other bytes.
    frame = bytes(slot[16:used].numpy())
    silent = 0
    for bit in bits[128:]:
        bad = bytearray(frame)
        bad[bit // 8 - 16] ^= 1 << (bit % 8)
        with contextlib.suppress(CorruptChunk):  # blosc2 refused it: not silent
            silent += lossless.decode(bytes(bad), RAW) != bytes(raw.numpy())
    assert silent > SAMPLED_BITS // 2
    # The slot's unused bytes are no part of the frame: they do not change the chunk.
    slack = slot.clone()
    slack[used:] ^= 0xFF
    out = torch.empty(RAW, dtype=torch.uint8)
    codec.decode(slack, out)
    assert torch.equal(out, raw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_every_sampled_bit_flip_of_an_fp8_chunk_fails_its_decode(dtype: torch.dtype) -> None:
    codec = Fp8Chunks(dtype, RAW)
    slot = encoded(codec, kv(dtype, seed=1))
    assert codec.stored_bytes == 8 + RAW // dtype.itemsize + 4 * (RAW // dtype.itemsize // 4096)
    assert_every_flip_fails(codec, slot, sampled_bits(codec.stored_bytes, seed=42))
    with pytest.raises(CorruptChunk, match="not a chunk"):
        codec.decode(slot[:-1], torch.empty(RAW, dtype=torch.uint8))


@pytest.mark.parametrize("codec", ["lossless", "fp8"])
def test_a_load_of_a_changed_slot_fails_its_job_and_writes_no_block(codec: str) -> None:
    engine = vllm_cpu(16, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(5)
    for t in engine.caches.values():
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    worker = TransferWorker.for_kv_caches(
        engine.caches, 16, blocks_per_chunk=2, host_budget_bytes=1 << 20, codec=codec, threads=1
    )

    def run(j: EngineJob) -> JobResult:
        (worker.submit_store if j.kind is JobKind.STORE else worker.submit_load)(j)
        worker.wait([j.job_id])
        (result,) = worker.poll()
        return result

    try:
        assert run(job(1, JobKind.STORE, [0, 1], [0, 1, 2, 3], 2)).success
        slot = worker.slab.data[1]
        slot[20] ^= 0x10  # one bit in the second chunk's frame
        untouched = [record(engine, b) for b in (10, 11)]
        failed = run(job(2, JobKind.LOAD, [1], [10, 11], 2))
        assert not failed.success and "checksum" in str(failed.error)
        assert [record(engine, b) for b in (10, 11)] == untouched
        assert run(job(3, JobKind.LOAD, [0], [12, 13], 2)).success  # the good slot loads
        if codec == "lossless":
            assert [record(engine, b) for b in (12, 13)] == [record(engine, b) for b in (0, 1)]
    finally:
        worker.shutdown()
