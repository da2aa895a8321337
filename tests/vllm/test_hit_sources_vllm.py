"""Per-tier hit sources (``get_external_cache_hit_sources``) on vLLM's real scheduler:
vLLM's prefix-cache stats count each hit under the tier kvoffload loaded it from."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvoffload.adapters.vllm.compat import CacheHitSource
from kvoffload.testing.vllm_harness import VllmHarness
from kvoffload.testing.vllm_harness.spec import HEAD_SIZE, HEADS, LAYERS
from kvoffload.tiers.disk import slot_bytes

MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]
CHUNK = len(LAYERS) * HEADS * 16 * 2 * HEAD_SIZE * 4  # one block of 16 tokens
DOC = list(range(10, 74))  # 4 chunks of one block


def with_stats(h: VllmHarness) -> Any:
    """vLLM's connector prefix-cache stats, as a scheduler with ``log_stats`` keeps
    them (the harness's scheduler is built without)."""
    from vllm.v1.metrics.stats import PrefixCacheStats

    h.scheduler.connector_prefix_cache_stats = PrefixCacheStats()
    return h.scheduler.connector_prefix_cache_stats


def serve(h: VllmHarness, request_id: str, prompt: list[int]) -> None:
    h.add_request(request_id, prompt, 2)
    h.run()
    assert h.output_tokens(request_id) == h.model.reference_output(request_id, prompt, 2)


@pytest.mark.parametrize("async_scheduling", MODES)
def test_a_host_hit_counts_as_host(make: Any, async_scheduling: bool) -> None:
    h: VllmHarness = make(async_scheduling=async_scheduling)
    serve(h, "a", DOC)
    h.reset_prefix_cache()
    stats = with_stats(h)
    serve(h, "b", [*DOC, 5, 6, 7])
    assert h.scheduler_half.metrics.value("hit_tokens_total", tier="host") == 64
    assert stats.hits == 64
    assert stats.hits_by_source == {CacheHitSource.HOST: 64}


@pytest.mark.parametrize("async_scheduling", MODES)
def test_a_disk_hit_counts_as_disk(make: Any, tmp_path: Path, async_scheduling: bool) -> None:
    """DOC pushed out of host memory by fillers: the disk alone holds it, and vLLM's
    stats count its tokens under ``disk`` (with any chunk still in host memory under
    ``host``), summing to the hit."""
    h: VllmHarness = make(
        async_scheduling=async_scheduling,
        cpu_bytes=4 * CHUNK,
        extra={"disk_path": str(tmp_path / "disk"), "disk_bytes": 256 * slot_bytes(CHUNK)},
    )
    serve(h, "doc", DOC)
    for i in range(3):
        serve(h, f"filler{i}", [1000 - i, *DOC[1:]])
    h.reset_prefix_cache()
    stats = with_stats(h)
    serve(h, "doc again", DOC)
    metrics = h.scheduler_half.metrics
    disk = int(metrics.value("hit_tokens_total", tier="disk"))
    host = int(metrics.value("hit_tokens_total", tier="host"))
    assert disk > 0  # the mode this test claims: a hit from the disk tier
    assert stats.hits == disk + host > 0
    expected = {CacheHitSource.DISK: disk, CacheHitSource.HOST: host}
    assert stats.hits_by_source == {s: n for s, n in expected.items() if n}
