"""The fp8 codec on a real engine (vLLM CPU, float32 KV, greedy; issue 33).

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
