"""``bench/codec_frame_check.py`` times what it says: each slot codec's encode and
decode with its checksum and with a constant in its place (the same frames otherwise),
the checksum alone and a plain copy, per chunk; lossless stays exact through its slot."""

from __future__ import annotations

import torch
from tests.bench_modules import bench_module


def test_each_codec_is_timed_with_and_without_its_checksum() -> None:
    bench = bench_module("codec_frame_check")
    values = torch.randn(4 * 8192, generator=torch.Generator().manual_seed(3))
    data = values.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    us = bench.measure(data, torch.bfloat16, 16 * 1024, rounds=1)
    for codec in ("lossless", "fp8"):
        for variant in (codec, f"{codec}, no checksum"):
            assert us[f"{variant} encode"] > 0 and us[f"{variant} decode"] > 0
        assert us[f"{codec} xxh3 alone"] > 0
    assert us["copy"] > 0
    table = bench.slot_codecs(torch.bfloat16, 1 << 14)
    plain, unchecked = table["fp8"], table["fp8, no checksum"]
    raw = torch.frombuffer(bytearray(data[: 1 << 14]), dtype=torch.uint8)
    slots = [torch.zeros(plain.stored_bytes, dtype=torch.uint8) for _ in range(2)]
    plain.encode(raw, slots[0])
    unchecked.encode(raw, slots[1])
    assert torch.equal(slots[0][8:], slots[1][8:])  # the same frame but for its checksum
    assert not torch.equal(slots[0][:8], slots[1][:8])
