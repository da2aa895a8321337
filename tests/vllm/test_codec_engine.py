"""Chunk codecs on a real engine (vLLM CPU, float32 KV, greedy; issue 33).

A host tier of 16 raw chunks' bytes serves a cyclic pattern of 32 chunks (four
8-block prompts, each sent again after the other three): with ``codec: none`` LRU
keeps evicting the chunk needed next, with ``codec: fp8`` the same bytes hold about
64 chunks (float32 KV encoded 3.9x smaller) and the whole cycle. The test asserts the
mode (the host tier's slots, the namespace naming the codec), that fp8 serves at
least 1.8x the cached tokens of none, and that fp8 with a disk tier below serves
hits from disk too; outputs are compared with no offload and their agreement
printed (fp8 is lossy: agreement is measured, not asserted).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from llm_support import BLOCK, CHUNK_BYTES, engine, generate, half, settle, tokens

pytestmark = pytest.mark.slow

BLOCKS = 8
CYCLES = 3


def prompt(p: int) -> list[int]:
    return [(7 * p + 3 * i) % 997 + 3 for i in range(BLOCKS * BLOCK)]


def serve_cycle(llm: Any, offload: bool = True) -> tuple[int, list[list[int]]]:
    """Prompts 0-3, ``CYCLES`` times, one at a time: cached tokens, outputs."""
    cached, outs = 0, []
    for _ in range(CYCLES):
        for p in range(4):
            (out,) = generate(llm, [prompt(p)], max_tokens=4)
            if offload:
                settle(llm)
            cached += out.num_cached_tokens
            outs.extend(tokens([out]))
    return cached, outs


def run(tiny_model: Path, extra: dict[str, Any] | None) -> tuple[int, list[list[int]], Any]:
    with engine(tiny_model, extra, kv_blocks=20, max_num_seqs=1, max_model_len=320) as llm:
        cached, outs = serve_cycle(llm, extra is not None)
        h = half(llm) if extra is not None else None
        slots = h.directory.num_slots if h is not None else 0
        namespace = h.namespace.dtype if h is not None else ""
    return cached, outs, (slots, namespace)


def test_fp8_holds_the_cycle_that_none_thrashes(tiny_model: Path, tmp_path: Path) -> None:
    host = {"cpu_bytes": 16 * CHUNK_BYTES}
    none_cached, none_out, (none_slots, none_ns) = run(tiny_model, host)
    fp8_cached, fp8_out, (fp8_slots, fp8_ns) = run(tiny_model, {**host, "codec": "fp8"})
    _, reference, _ = run(tiny_model, None)
    same = sum(a == b for a, b in zip(fp8_out, reference, strict=True))
    print(f"cached tokens: none {none_cached}, fp8 {fp8_cached}; host slots {none_slots} -> "
          f"{fp8_slots}; fp8 outputs equal to no offload: {same}/{len(reference)}")  # fmt: skip
    assert none_slots == 16 and fp8_slots >= 60  # the mode: 3.9x the chunks, same bytes
    assert none_ns == "torch.float32" and fp8_ns == "torch.float32+fp8"
    assert none_out == reference  # no codec: exact
    assert fp8_cached >= 1.8 * none_cached and fp8_cached > 0


def test_fp8_chunks_come_back_from_disk(tiny_model: Path, tmp_path: Path) -> None:
    extra = {
        "cpu_bytes": 8 * CHUNK_BYTES,
        "codec": "fp8",
        "disk_path": str(tmp_path / "disk"),
        "disk_bytes": 256 * (CHUNK_BYTES + 4096),
        "tier_io_timeout_ms": 60_000,
    }
    with engine(tiny_model, extra, kv_blocks=20, max_num_seqs=1, max_model_len=320) as llm:
        cached, _ = serve_cycle(llm)
        h = half(llm)
        disk = h.tiers.tier("disk")
        read = disk.metrics.breakdown("transferred_chunks_total", "direction")
    print(f"fp8 over host (8 raw chunks) and disk: cached {cached}, disk reads {read}")
    assert read.get("load", 0) + read.get("promote", 0) > 0
    assert cached > 0


def side(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side


def tier_reads(llm: Any, name: str) -> int:
    read = half(llm).tiers.tier(name).metrics.breakdown("transferred_chunks_total", "direction")
    return int(read.get("load", 0) + read.get("promote", 0))


def test_lossless_outputs_are_identical_to_no_offload(tiny_model: Path) -> None:
    """Done-when: ``codec: lossless`` gives outputs identical to no offload (host
    slots keep the raw size plus the frame: 40 raw chunks' bytes hold the cycle's 32
    chunks, loaded back every cycle after the first)."""
    cached, outs, (slots, namespace) = run(
        tiny_model, {"cpu_bytes": 40 * CHUNK_BYTES, "codec": "lossless"}
    )
    _, reference, _ = run(tiny_model, None)
    print(f"lossless: cached {cached}, host slots {slots}, namespace {namespace}")
    assert namespace == "torch.float32+lossless" and slots == 39  # 40 x 32 KiB / (32 KiB + 64)
    assert cached >= 2048  # every prompt of the last two cycles: 7 of its 8 blocks
    assert outs == reference


def test_per_tier_codecs_re_encode_between_tiers(
    tiny_model: Path, tmp_path: Path, redis_server: Any
) -> None:
    """Host memory ``none`` over Redis ``lossless``, then over disk ``fp8``: Redis
    values are the encoded frames, chunks come back from both, the disk tier holds
    more chunks in its bytes, and over Redis lossless the outputs are identical to no
    offload."""
    _, reference, _ = run(tiny_model, None)
    redis_server.client().flushall()
    lossless_below = {
        "cpu_bytes": 4 * CHUNK_BYTES, "redis_url": redis_server.url, "redis_codec": "lossless",
        "tier_io_timeout_ms": 60_000,
    }  # fmt: skip
    with engine(tiny_model, lossless_below, kv_blocks=20, max_num_seqs=1, max_model_len=320) as llm:
        cached, outs = serve_cycle(llm)
        namespace, redis_reads = half(llm).namespace.dtype, tier_reads(llm, "redis")
        ratio = side(llm).read_metrics().value("codec_ratio", tier="redis")
        line = side(llm).summary("recompute")
    client = redis_server.client()
    names = [n for n in client.keys("kvoffload:v1:*") if not n.endswith(b":namespace")]
    sizes = [client.strlen(n) for n in names]
    print(f"host none / redis lossless: cached {cached}, redis reads {redis_reads}, "
          f"{len(sizes)} values of {min(sizes)}-{max(sizes)} B, raw {CHUNK_BYTES}")  # fmt: skip
    assert namespace == "torch.float32+host:none,redis:lossless"
    assert sizes and max(sizes) < 64 + CHUNK_BYTES  # encoded, stored at their size
    # measured: raw bytes over the bytes the workers wrote to Redis (frames, no header)
    assert CHUNK_BYTES / (max(sizes) - 64) * 0.99 <= ratio <= CHUNK_BYTES / (min(sizes) - 64)
    assert "codecs: host none 1.00x, redis lossless <= 1.00x, measured on /metrics" in line
    assert redis_reads > 0 and cached > 0
    assert outs == reference
    fp8_below = {
        "cpu_bytes": 4 * CHUNK_BYTES, "disk_path": str(tmp_path / "disk"),
        "disk_bytes": 32 * (CHUNK_BYTES + 4096), "disk_codec": "fp8",
        "tier_io_timeout_ms": 60_000,
    }  # fmt: skip
    with engine(tiny_model, fp8_below, kv_blocks=20, max_num_seqs=1, max_model_len=320) as llm:
        cached, _ = serve_cycle(llm)
        g = side(llm).geometry
        disk_reads = tier_reads(llm, "disk")
        disk_ratio = side(llm).read_metrics().value("codec_ratio", tier="disk")
    print(f"host none / disk fp8: cached {cached}, disk slots {g.tier_slots['disk']}, "
          f"disk reads {disk_reads}")  # fmt: skip
    assert g.codec == "none" and g.tier_codec("disk") == "fp8"
    # fp8 chunks of float32 KV are 3.9x smaller; a disk slot pads its payload to 4 KiB
    # pages behind a 4 KiB header, so these tiny chunks take 16 KiB instead of 36 KiB
    assert g.tier_slots["disk"] == 32 * (CHUNK_BYTES + 4096) // (4096 + 12288) == 72
    assert disk_reads > 0 and cached > 0
    assert 3.99 < disk_ratio < 4.0  # float32 to e4m3 and a scale per 4,096 values
