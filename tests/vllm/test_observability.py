"""Metrics and KV events from a real in-process vLLM run.

One engine run with kvoffload (host memory for eight chunks), vLLM's stat loggers
on, kvoffload's metrics endpoint on a loopback port and vLLM's KV events captured at
the publisher. The run: prompt 0 (8 chunks stored), prompt 0 again after the
engine's own prefix cache is reset (all 8 chunks loaded back), then prompts 1 and 2
(16 more chunks: host memory evicts; prompt 2 with a cache salt). The scraped
numbers are checked against what that run did.
"""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llm_support import BLOCK, CHUNK_BYTES, PROMPTS, engine, generate, half, settle

from kvoffload.testing.redis_server import free_port

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """``kvoffload_*`` samples: (name, sorted labels without vLLM's own) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith("kvoffload_"):
                continue
            labels = tuple(
                sorted(
                    (k, v) for k, v in sample.labels.items() if k not in ("engine", "model_name")
                )
            )
            out[(sample.name, labels)] = out.get((sample.name, labels), 0.0) + sample.value
    return out


def get(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def run(tiny_model: Path) -> Iterator[dict[str, Any]]:
    from prometheus_client import REGISTRY, generate_latest
    from vllm.config import KVEventsConfig

    port = free_port()
    extra = {"cpu_bytes": 8 * CHUNK_BYTES, "metrics_port": port}
    events = KVEventsConfig(enable_kv_cache_events=True, publisher="null")
    with engine(tiny_model, extra, kv_events_config=events, disable_log_stats=False) as llm:
        batches: list[Any] = []
        core = llm.llm_engine.engine_core.engine_core
        core.scheduler.kv_event_publisher.publish = batches.append
        first = generate(llm, [PROMPTS[0]])[0]
        settle(llm)
        llm.reset_prefix_cache()  # the engine forgets; kvoffload still holds prompt 0
        again = generate(llm, [PROMPTS[0]])[0]
        settle(llm)
        generate(llm, [PROMPTS[1]])
        settle(llm)
        generate(llm, [PROMPTS[2]], salt="tenant")  # extra keys in its first block
        settle(llm)
        generate(llm, [[5, 6, 7]])  # one more step through the engine loop: stats delivered
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            endpoint = parse(response.read().decode())
        yield {
            "endpoint": endpoint,
            "vllm": parse(generate_latest(REGISTRY).decode()),
            "events": [e for batch in batches for e in batch.events],
            "first": first,
            "again": again,
            "lookups": half(llm).metrics.value("lookups_total", tier="host"),
        }


def test_the_endpoint_reports_what_the_run_did(run: dict[str, Any]) -> None:
    m, again = run["endpoint"], run["again"]
    assert run["first"].num_cached_tokens == 0
    assert again.num_cached_tokens == 8 * BLOCK  # every block came from kvoffload
    assert get(m, "kvoffload_hit_tokens_total", tier="host") == 8 * BLOCK
    assert get(m, "kvoffload_transferred_chunks_total", direction="load", tier="host") == 8
    stored = get(m, "kvoffload_transferred_chunks_total", direction="store", tier="host")
    assert stored == 3 * 8  # three distinct prompts of eight chunks; the repeat stored nothing
    assert get(m, "kvoffload_evictions_total", tier="host") == stored - 8  # host holds eight
    assert get(m, "kvoffload_usage_bytes", tier="host") == 8 * CHUNK_BYTES
    assert get(m, "kvoffload_capacity_bytes", tier="host") == 8 * CHUNK_BYTES
    assert get(m, "kvoffload_pinned_chunks", tier="host") == 0
    assert get(m, "kvoffload_jobs_in_flight") == 0
    # Byte histograms: one observation per job and worker, the sum is every byte moved.
    assert get(m, "kvoffload_transfer_bytes_sum", direction="store", tier="host") == (
        stored * CHUNK_BYTES
    )
    assert get(m, "kvoffload_transfer_bytes_sum", direction="load", tier="host") == 8 * CHUNK_BYTES
    assert get(m, "kvoffload_transfer_bytes_count", direction="load", tier="host") == 1
    assert get(m, "kvoffload_transfer_seconds_count", direction="load", tier="host") == 1
    assert get(m, "kvoffload_failed_chunks_total", direction="load", tier="host") == 0
    assert get(m, "kvoffload_lookups_total", tier="host") == run["lookups"]
    # The load measured host memory's lane: its figures for routers are there.
    load_s = get(m, "kvoffload_tier_load_seconds_per_chunk", tier="host")
    assert math.isfinite(load_s) and load_s > 0
    assert ("kvoffload_tier_hit_weight", (("tier", "host"),)) in m
    assert 0 <= get(m, "kvoffload_tier_hit_weight", tier="host") <= 1


def test_vllm_metrics_path_carries_the_same_numbers(run: dict[str, Any]) -> None:
    ours, theirs = run["endpoint"], run["vllm"]
    for name, labels in [
        ("kvoffload_hit_tokens_total", {"tier": "host"}),
        ("kvoffload_transferred_chunks_total", {"direction": "store", "tier": "host"}),
        ("kvoffload_transferred_chunks_total", {"direction": "load", "tier": "host"}),
        ("kvoffload_evictions_total", {"tier": "host"}),
        ("kvoffload_transfer_bytes_sum", {"direction": "store", "tier": "host"}),
        ("kvoffload_transfer_bytes_count", {"direction": "store", "tier": "host"}),
        ("kvoffload_usage_bytes", {"tier": "host"}),
    ]:
        assert get(theirs, name, **labels) == get(ours, name, **labels) > 0, name


def test_kv_events_name_the_engines_block_hashes_per_tier(run: dict[str, Any]) -> None:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    events = run["events"]
    # vLLM's own events are the engine's (GPU); kvoffload's host tier publishes CPU,
    # LOCAL, with no ownership, as vLLM's own CPU offloading does (routers credit it).
    ours = [e for e in events if getattr(e, "medium", None) == "CPU"]
    stored = [e for e in ours if isinstance(e, BlockStored)]
    removed = [e for e in ours if isinstance(e, BlockRemoved)]
    assert len(stored) == 24 and len(removed) == 16  # 24 chunks stored, host holds 8
    assert all(len(e.block_hashes) == 1 for e in stored)
    assert all(e.locality == "LOCAL" and e.ownership is None for e in ours)
    assert all(e.block_size == BLOCK and len(e.token_ids) == BLOCK for e in stored)
    # Every hash kvoffload announces is one the engine announced for its own blocks.
    engine_hashes = {
        h
        for e in events
        if isinstance(e, BlockStored) and getattr(e, "medium", None) == "GPU"
        for h in e.block_hashes
    }
    assert {h for e in stored for h in e.block_hashes} <= engine_hashes
    first_chunk = next(e for e in stored if e.parent_block_hash is None)
    assert first_chunk.token_ids == PROMPTS[0][:BLOCK]
    # What was removed had been stored, and what is left is what host memory holds.
    stored_hashes = [h for e in stored for h in e.block_hashes]
    removed_hashes = [h for e in removed for h in e.block_hashes]
    assert set(removed_hashes) <= set(stored_hashes)
    assert len(set(stored_hashes) - set(removed_hashes)) == 8


def test_kv_events_carry_the_engines_extra_keys(run: dict[str, Any]) -> None:
    from vllm.distributed.kv_events import BlockStored

    stored = [e for e in run["events"] if isinstance(e, BlockStored)]
    engines = {  # block hash -> its extra keys in vLLM's own events
        h: k
        for e in stored
        if getattr(e, "medium", None) == "GPU"
        for h, k in zip(e.block_hashes, e.extra_keys or [None] * len(e.block_hashes), strict=True)
    }
    ours = [
        (engines[h], k, e.lora_id, e.lora_name)
        for e in stored
        if getattr(e, "medium", None) == "CPU"
        for h, k in zip(e.block_hashes, e.extra_keys or (), strict=True)
    ]
    assert len(ours) == 24 and all(theirs == mine for theirs, mine, _, _ in ours)
    assert sum(mine == ("tenant",) for _, mine, _, _ in ours) == 1  # prompt 2's first block
    assert {(lora_id, name) for _, _, lora_id, name in ours} == {(None, None)}
