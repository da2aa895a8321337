"""KV cache groups on vLLM's real scheduler (its hybrid KV cache manager): sliding
window groups alone, with a full-attention group, windows of different sizes. The
harness's model reads, per group, exactly what the group's attention reads, so a
chunk of the wrong group, position or request anywhere fails these tests. Each runs
on the synchronous and the asynchronous scheduler."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
)

from kvoffload.core.errors import ConfigError
from kvoffload.core.jobs import JobKind, TransferJob
from kvoffload.testing.vllm_harness import CompleteAll, VllmHarness
from kvoffload.testing.vllm_harness.spec import HEAD_SIZE, HEADS

MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]
BLOCK = 16
DOC = list(range(10, 170))  # 160 tokens: 10 chunks of one block, several windows long


def engine_groups(h: VllmHarness) -> tuple[str, list[tuple[str, int | None]]]:
    """vLLM's coordinator and, per group, its manager and window."""
    managers = h.runner.managers
    kinds = [(type(m).__name__, getattr(m, "sliding_window", None)) for m in managers]
    return type(h.scheduler.kv_cache_manager.coordinator).__name__, kinds


def serve(h: VllmHarness, request_id: str, prompt: list[int], max_tokens: int = 4) -> None:
    h.add_request(request_id, prompt, max_tokens)
    h.run()
    assert h.output_tokens(request_id) == h.model.reference_output(request_id, prompt, max_tokens)


@pytest.mark.parametrize("async_scheduling", MODES)
@pytest.mark.parametrize(
    ("groups", "coordinator", "loaded_chunks"),
    [
        # window 64 after 160 tokens reads tokens 97..159: chunks 6-9
        pytest.param((64,), "UnitaryKVCacheCoordinator", 4, id="window"),
        # every chunk of the full group, chunks 8-9 of window 32
        pytest.param((None, 32), "HybridKVCacheCoordinator", 10 + 2, id="full+window"),
        pytest.param((32, 64), "HybridKVCacheCoordinator", 2 + 4, id="two-windows"),
    ],
)
def test_window_groups_are_served_from_kvoffload_after_a_prefix_cache_reset(
    make: Any,
    async_scheduling: bool,
    groups: tuple[int | None, ...],
    coordinator: str,
    loaded_chunks: int,
) -> None:
    h = make(groups=groups, num_blocks=64, async_scheduling=async_scheduling)
    managers = [
        ("FullAttentionManager" if w is None else "SlidingWindowManager", w) for w in groups
    ]
    assert engine_groups(h) == (coordinator, managers)
    serve(h, "a", DOC)
    h.reset_prefix_cache()
    serve(h, "b", [*DOC, 5, 6, 7])
    (load,) = h.jobs_of(JobKind.LOAD)
    assert load.request_id == "b" and len(load.keys) == loaded_chunks
    assert h.loads_checked == 1  # b's loaded blocks held b's KV of their group
    assert h.scheduler_half.metrics.value("hit_tokens_total", tier="host") == len(DOC)
    assert h.scheduler_half.stats.load_failures == 0
    h.quiescent()


def page_sized(spec: str) -> KVCacheSpec:
    """A spec of a kind kvoffload does not serve, of the harness's page size."""
    page = BLOCK * HEADS * 2 * HEAD_SIZE * 4
    if spec == "chunked-local":
        return ChunkedLocalAttentionSpec(
            block_size=BLOCK,
            num_kv_heads=HEADS,
            head_size=HEAD_SIZE,
            dtype=torch.float32,
            attention_chunk_size=32,
        )
    return MambaSpec(block_size=BLOCK, shapes=((page // 4,),), dtypes=(torch.float32,))


@pytest.mark.parametrize(
    ("kind", "named"),
    [
        ("chunked-local", r"ChunkedLocalAttentionSpec\(attention_chunk_size=32\)"),
        ("mamba", r"MambaSpec"),
    ],
)
def test_a_group_kvoffload_cannot_serve_is_refused_at_start(
    make: Any, tiny_model: Path, kind: str, named: str
) -> None:
    full = FullAttentionSpec(
        block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32
    )
    with pytest.raises(ConfigError, match=rf"group 1 of {tiny_model}.* is {named}") as caught:
        make(kv_specs=(full, page_sized(kind)))
    assert "serve this model without kvoffload" in str(caught.value)


def owners(h: VllmHarness) -> dict[int, tuple[str, int, int]]:
    """Every engine block a running request holds: (request, group, index)."""
    null = h.model.null_block
    return {
        block: (request_id, group, index)
        for request_id in h.scheduler.requests
        for group, table in enumerate(h.runner.tables(request_id))
        for index, block in enumerate(table)
        if block != null
    }


@pytest.mark.parametrize("async_scheduling", MODES)
def test_a_window_block_handed_out_again_flushes_the_store_reading_it_first(
    make: Any, async_scheduling: bool
) -> None:
    """Every copy is held (a store runs only when a plan flushes it). ``a``'s window
    group frees its blocks below the window mid-prefill; the engine hands them out
    again (to ``a`` itself on a tight pool; with async scheduling, which frees a step
    later, to ``b``) while the stores that read them are unfinished: the step that
    writes them flushes those stores first (the harness checks every write)."""
    h = make(groups=(None, 32), num_blocks=20 if async_scheduling else 16,
             async_scheduling=async_scheduling)  # fmt: skip
    h.policy = CompleteAll(release=False)
    h.add_request("a", DOC[:128], 4)
    seen: dict[int, tuple[str, int, int]] = {}
    fenced: list[tuple[int, int]] = []  # (step, block) handed out again and flushed
    for _ in range(12):
        if len(h.steps) == 3:
            h.add_request("b", list(range(500, 534)), 2)
        h.step()
        now = owners(h)
        step = h.steps[-1]
        flushed = {i for r in h.steps for i in r.plan.flush}
        for block, owner in now.items():
            before = seen.get(block)
            if before is None or before == owner or before[1] != 1:
                continue  # not a window block of an earlier owner
            readers = [
                j.job_id for r in h.steps[:-1] for j in r.plan.stores if block in j.block_ids
            ]
            assert readers and readers[-1] in flushed  # its last store before this step
            fenced.append((step.step, block))
        seen.update(now)
    assert fenced, "no window block was handed out again while its store was held"
    h.policy = CompleteAll()
    h.run()
    assert h.output_tokens("a") == h.model.reference_output("a", DOC[:128], 4)
    assert h.scheduler_half.metrics.value("flushes_total") > 0
    h.quiescent()


@dataclass
class FailLoads(CompleteAll):
    """Every copy completes at once; every load fails."""

    def copies(
        self, rank: int, step: int, jobs: Sequence[TransferJob]
    ) -> tuple[set[int], set[int]]:
        loads = {j.job_id for j in jobs if j.kind is JobKind.LOAD}
        return {j.job_id for j in jobs} - loads, loads


@pytest.mark.parametrize("async_scheduling", MODES)
@pytest.mark.parametrize(
    "groups", [(None,), (64,), (None, 32)], ids=["full", "window", "full+window"]
)
def test_a_failed_load_is_recomputed_whatever_the_groups(
    make: Any, async_scheduling: bool, groups: tuple[int | None, ...]
) -> None:
    """One full-attention group: the failed blocks are reported invalid, vLLM
    recomputes from the first. Otherwise the request is reported in
    ``failed_recving`` and vLLM recomputes it whole. With several groups vLLM raised
    RuntimeError on invalid blocks (block ids name no group; it kills the engine);
    with one window group it recomputed from the first invalid block, reading the
    window before it from its null blocks (the harness: "does not hold its own KV")."""
    h = make(groups=groups, num_blocks=64, async_scheduling=async_scheduling)
    serve(h, "a", DOC)
    h.reset_prefix_cache()
    h.policy = FailLoads()
    serve(h, "b", [*DOC, 5, 6, 7])
    failed = {rid for r in h.steps for rid in r.failed_recving}
    invalid = {b for r in h.steps for b in r.invalid_blocks}
    if groups == (None,):
        assert not failed and invalid
    else:
        assert failed == {"b"} and not invalid
    assert h.scheduler_half.stats.load_failures == 1 and h.loads_checked == 0
    h.quiescent()
