"""Chunks through codecs (issue 33, decision 0023): the lossless slot codec is
bit-exact and refuses slots it did not write; the codec copier stores and loads
lossless chunks bit for bit; a lower tier of another codec than host memory
(``transfer/tier_codecs.py``) re-encodes on spill and promotion, a tier keyed by
chunk stores only a lossless chunk's used bytes, a chunk the tier codec cannot encode
fails alone, and a tier copy that does not decode is an integrity failure."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from kv_engines import job, record, vllm_cpu

from kvoffload.codecs import fp8
from kvoffload.codecs.chunk_codec import (
    LOSSLESS_OVERHEAD,
    ChunkCodec,
    Fp8Chunks,
    LosslessChunks,
    open_codec,
    stored_bytes,
)
from kvoffload.codecs.lossless import CorruptChunk
from kvoffload.core.failures import ChunkFailure, FailureKind
from kvoffload.core.jobs import JobKind
from kvoffload.core.keys import ChunkKey
from kvoffload.tiers.host import HostSlab
from kvoffload.transfer import register_kv_caches
from kvoffload.transfer.codec_copy import CodecCopier
from kvoffload.transfer.plan import plan_job
from kvoffload.transfer.tier_codecs import CodecTierStore, through_codecs

RAW = 1 << 14


def kv(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A raw chunk (uint8) of ``dtype`` values like KV: small, of few exponents."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(RAW // dtype.itemsize, generator=g).to(dtype)
    return values.view(torch.uint8).clone()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_a_lossless_slot_is_bit_exact_and_framed(dtype: torch.dtype) -> None:
    codec = LosslessChunks(dtype.itemsize, RAW)
    assert codec.stored_bytes == stored_bytes("lossless", RAW, dtype.itemsize) == RAW + 64
    raw = kv(dtype)
    slot = torch.full((codec.stored_bytes,), 0xAB, dtype=torch.uint8)
    codec.encode(raw, slot)
    used = codec.used_bytes(slot.numpy().data)
    assert used < RAW  # random normal values still shrink: the exponent plane
    out = torch.empty(RAW, dtype=torch.uint8)
    codec.decode(slot, out)
    assert torch.equal(out, raw)
    incompressible = torch.randint(0, 256, (RAW,), dtype=torch.uint8)
    codec.encode(incompressible, slot)
    assert RAW < codec.used_bytes(slot.numpy().data) <= RAW + LOSSLESS_OVERHEAD
    codec.decode(slot, out)
    assert torch.equal(out, incompressible)


def test_a_lossless_slot_it_did_not_write_is_refused() -> None:
    codec = LosslessChunks(2, RAW)
    out = torch.empty(RAW, dtype=torch.uint8)
    for bad in (torch.zeros(codec.stored_bytes, dtype=torch.uint8),  # length 0
                torch.full((codec.stored_bytes,), 0xFF, dtype=torch.uint8)):  # fmt: skip
        with pytest.raises(CorruptChunk):
            codec.decode(bad, out)
    slot = torch.zeros(codec.stored_bytes, dtype=torch.uint8)
    codec.encode(kv(torch.bfloat16), slot)
    slot[20:40] ^= 0x5A  # inside blosc2's frame
    with pytest.raises(ValueError):
        codec.decode(slot, out)
        assert not torch.equal(out, kv(torch.bfloat16))  # decoded, but wrong: never here


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_the_codec_copier_stores_and_loads_lossless_chunks_bit_for_bit(
    dtype: torch.dtype,
) -> None:
    engine = vllm_cpu(16, dtype=dtype)
    g = torch.Generator().manual_seed(1)
    for t in engine.caches.values():
        t.copy_(torch.randn(t.shape, generator=g).to(dtype))
    layout = register_kv_caches(engine.caches, engine.num_blocks)
    codec = LosslessChunks(dtype.itemsize, layout.chunk_bytes(2))
    slab = HostSlab(codec.stored_bytes, codec.stored_bytes * 4)
    copier = CodecCopier(layout, slab, 2, codec, threads=1)

    def run(i: int, kind: JobKind, slots: list[int], blocks: list[int]) -> None:
        plan = plan_job(
            job(i, kind, slots, blocks, 2), kind, num_blocks=16, num_slots=slab.num_slots,
            blocks_per_chunk=2, block_bytes=layout.block_bytes,
        )  # fmt: skip
        (copier.store if kind is JobKind.STORE else copier.load)(plan)

    before = [record(engine, b) for b in range(4)]
    run(1, JobKind.STORE, [2, 0], [0, 1, 2, 3])
    run(2, JobKind.LOAD, [2, 0], [8, 9, 10, 11])
    assert [record(engine, b) for b in range(8, 12)] == before


class Tier:
    """A tier store in memory that keeps what it is given (keyed by chunk)."""

    def __init__(self) -> None:
        self.values: dict[ChunkKey, bytes] = {}

    def write_many(
        self, items: Sequence[tuple[ChunkKey, memoryview]], slots: Sequence[int],
        groups: Sequence[int] = (),
    ) -> list[ChunkFailure | None]:  # fmt: skip
        for key, view in items:
            self.values[key] = bytes(view)
        return [None] * len(items)

    def read_many(
        self, keys: Sequence[ChunkKey], slots: Sequence[int], outs: Sequence[memoryview],
        groups: Sequence[int] = (),
    ) -> list[ChunkFailure | None]:  # fmt: skip
        for key, out in zip(keys, outs, strict=True):
            value = self.values[key]
            out[: len(value)] = value
        return [None] * len(keys)

    def delete_many(self, keys: Sequence[ChunkKey]) -> None:
        for key in keys:
            self.values.pop(key, None)


def K(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def slot_of(codec: ChunkCodec | None, raw: torch.Tensor) -> memoryview:
    if codec is None:
        return raw.clone().numpy().data
    slot = torch.zeros(codec.stored_bytes, dtype=torch.uint8)
    codec.encode(raw, slot)
    return slot.numpy().data


@pytest.mark.parametrize(
    ("host", "tier"),
    [
        ("none", "fp8"),
        ("none", "lossless"),
        ("fp8", "none"),
        ("lossless", "fp8"),
        ("fp8", "lossless"),
    ],
)
def test_a_tier_of_another_codec_re_encodes_both_ways(host: str, tier: str) -> None:
    dtype = torch.bfloat16
    host_codec = open_codec(host, dtype, RAW)
    tier_codec = open_codec(tier, dtype, RAW)
    inner = Tier()
    store = through_codecs(inner, host_codec, tier_codec, raw_bytes=RAW, keyed=True)
    assert isinstance(store, CodecTierStore)
    raw = kv(dtype, seed=2)
    assert store.write_many([(K(1), slot_of(host_codec, raw))], ()) == [None]
    kept = inner.values[K(1)]
    if tier == "fp8":
        assert len(kept) == stored_bytes("fp8", RAW, 2)
    elif tier == "lossless":  # keyed by chunk: only the frame's bytes
        assert len(kept) < RAW
    else:
        assert len(kept) == RAW
    size = RAW if host_codec is None else host_codec.stored_bytes
    out = torch.zeros(size, dtype=torch.uint8)
    assert store.read_many([K(1)], (), [out.numpy().data]) == [None]
    back = out if host_codec is None else torch.empty(RAW, dtype=torch.uint8)
    if host_codec is not None:
        host_codec.decode(out, back)
    if "fp8" in (host, tier):
        assert fp8.within_bound(raw.view(dtype), back.view(dtype), Fp8Chunks(dtype, RAW).run)
    else:
        assert torch.equal(back, raw)
    assert store.delete_many is not None  # the wrapped store's other calls pass through


def test_the_same_codec_passes_through_unless_a_keyed_tier_trims_it() -> None:
    inner = Tier()
    fp8_codec = open_codec("fp8", torch.float16, RAW)
    assert through_codecs(inner, fp8_codec, fp8_codec, raw_bytes=RAW, keyed=True) is inner
    assert through_codecs(inner, None, None, raw_bytes=RAW, keyed=True) is inner
    lossless = open_codec("lossless", torch.float16, RAW)
    assert through_codecs(inner, lossless, lossless, raw_bytes=RAW, keyed=False) is inner
    trimmed = through_codecs(inner, lossless, lossless, raw_bytes=RAW, keyed=True)
    assert trimmed is not inner
    raw = kv(torch.float16, seed=3)
    slot = slot_of(lossless, raw)
    trimmed.write_many([(K(7), slot)], ())
    assert lossless is not None and len(inner.values[K(7)]) == lossless.used_bytes(slot)
    out = torch.zeros(lossless.stored_bytes, dtype=torch.uint8)
    assert trimmed.read_many([K(7)], (), [out.numpy().data]) == [None]
    back = torch.empty(RAW, dtype=torch.uint8)
    lossless.decode(out, back)
    assert torch.equal(back, raw)


def test_a_chunk_the_tier_cannot_encode_fails_alone_and_a_bad_copy_is_integrity() -> None:
    dtype = torch.float16
    tier_codec = open_codec("fp8", dtype, RAW)
    inner = Tier()
    store = through_codecs(inner, None, tier_codec, raw_bytes=RAW, keyed=False)
    good, bad = kv(dtype, 4), kv(dtype, 5)
    bad.view(dtype)[3] = float("nan")
    failures = store.write_many([(K(1), slot_of(None, good)), (K(2), slot_of(None, bad))], [0, 1])
    assert failures[0] is None and failures[1] is not None
    assert failures[1].kind is FailureKind.IO and "codec fp8" in str(failures[1])
    assert set(inner.values) == {K(1)}
    lossless_tier = through_codecs(
        Tier(), None, open_codec("lossless", dtype, RAW), raw_bytes=RAW, keyed=True
    )
    assert isinstance(lossless_tier, CodecTierStore)
    lossless_tier.inner.values[K(3)] = b"\x10" + bytes(100)  # type: ignore[attr-defined]
    out = torch.zeros(RAW, dtype=torch.uint8)
    (failure,) = lossless_tier.read_many([K(3)], (), [out.numpy().data])
    assert failure is not None and failure.kind is FailureKind.INTEGRITY
    assert str(failure).startswith("integrity:codec")


@pytest.mark.parametrize(
    ("host", "tier"), [("none", "fp8"), ("fp8", "lossless"), ("none", "lossless")]
)
def test_a_flipped_bit_in_a_tier_copy_is_integrity_and_in_a_host_slot_fails_its_spill(
    host: str, tier: str
) -> None:
    """Issue 41: the frame's checksum is checked on every decode, whatever the tier."""
    dtype = torch.bfloat16
    host_codec, tier_codec = open_codec(host, dtype, RAW), open_codec(tier, dtype, RAW)
    inner = Tier()
    store = through_codecs(inner, host_codec, tier_codec, raw_bytes=RAW, keyed=True)
    assert store.write_many([(K(1), slot_of(host_codec, kv(dtype, seed=6)))], ()) == [None]
    value = bytearray(inner.values[K(1)])
    value[len(value) // 2] ^= 0x08
    inner.values[K(1)] = bytes(value)
    size = RAW if host_codec is None else host_codec.stored_bytes
    out = torch.zeros(size, dtype=torch.uint8)
    (failure,) = store.read_many([K(1)], (), [out.numpy().data])
    assert failure is not None and failure.kind is FailureKind.INTEGRITY
    assert failure.detail == "codec"  # a bounded reason: the metric's label
    if host_codec is None:
        return
    slot = torch.frombuffer(bytearray(slot_of(host_codec, kv(dtype, seed=7))), dtype=torch.uint8)
    slot[40] ^= 0x01
    (failure,) = store.write_many([(K(2), slot.numpy().data)], ())
    assert failure is not None and failure.kind is FailureKind.IO and "host slot" in str(failure)
    assert K(2) not in inner.values
