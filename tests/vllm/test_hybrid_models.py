"""Hybrid and sliding-window models on a real vLLM engine, with the hybrid KV cache
manager (HMA) on: a Gemma-3-style model (five 64-token window layers to one full
layer: six KV cache groups) and a Mistral-style model (every layer a 64-token
window: one sliding-window group). Float32 greedy outputs equal an engine without
offloading, and after the engine's own prefix cache is reset kvoffload serves the
prefixes (sync and really async scheduling; host memory, and a disk tier)."""

from __future__ import annotations

import random
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest
from llm_support import BLOCK, counted, generate, half, quiescent, settle, tokens
from llm_support import engine as llm_engine

from kvoffload.inspection.disk_scan import inspect_disk

MODES = [False, True]
PAGE = 2 * 2 * BLOCK * 32 * 4  # one layer's block: K and V, 2 heads of 32, float32


@pytest.fixture(scope="module")
def gemma3_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvoffload.demos.tiny_model import ensure_model

    return ensure_model("tiny-gemma3", tmp_path_factory.mktemp("models"))


def engine(
    model: Path, extra: dict[str, Any] | None, *, async_scheduling: bool, blocks: int = 320
) -> AbstractContextManager[Any]:
    """An engine whose block pool (shared by every KV cache group) holds ``blocks``
    blocks (vLLM sizes a window group for a whole prefill chunk, so a six-group model
    needs about six blocks per 32 tokens of its longest request); kvoffload
    configured by ``extra`` (None: none). The mode is asserted (``llm_support``)."""
    kv_bytes = blocks * PAGE * layers_per_group(model)
    return llm_engine(model, extra, kv_bytes=kv_bytes, async_scheduling=async_scheduling)


def layers_per_group(model: Path) -> int:
    """With HMA every group of these models holds one layer's share of a tensor per
    group layer: tiny-gemma3 one layer per group, tiny-swa both layers in one."""
    return 1 if "gemma3" in model.name else 2


def group_kinds(llm: Any) -> list[str]:
    core = llm.llm_engine.engine_core.engine_core
    assert core.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
    groups = core.scheduler.kv_cache_config.kv_cache_groups
    return [type(g.kv_cache_spec).__name__ for g in groups]


def prompts(seed: int) -> list[list[int]]:
    """Prompts sharing long prefixes (several windows long), and their repeats."""
    rng = random.Random(seed)
    shared = [[rng.randrange(3, 1000) for _ in range(6 * BLOCK)] for _ in range(2)]
    tails = [[rng.randrange(3, 1000) for _ in range(rng.randint(5, 70))] for _ in range(4)]
    return [shared[i % 2] + tails[i] for i in range(4)]


def run_twice(llm: Any, batch: list[list[int]]) -> tuple[list[list[int]], list[Any]]:
    """The batch, then (the engine's prefix cache reset) the batch again; the second
    run's outputs."""
    first = tokens(generate(llm, batch, max_tokens=24))
    settle(llm)
    llm.reset_prefix_cache()
    again = generate(llm, batch, max_tokens=24)
    settle(llm)
    return first, again


EXPECTED = {
    "tiny-gemma3": ["SlidingWindowSpec"] * 5 + ["FullAttentionSpec"],
    "tiny-swa": ["SlidingWindowSpec"],
}


@pytest.mark.parametrize("async_scheduling", MODES, ids=["sync", "async"])
@pytest.mark.parametrize("preset", ["tiny-gemma3", "tiny-swa"])
def test_hybrid_and_window_models_keep_hma_and_are_served_after_a_reset(
    gemma3_model: Path, tiny_swa_model: Path, preset: str, async_scheduling: bool
) -> None:
    model = gemma3_model if preset == "tiny-gemma3" else tiny_swa_model
    batch = prompts(1)
    with engine(model, None, async_scheduling=async_scheduling) as llm:
        assert group_kinds(llm) == EXPECTED[preset]
        plain = tokens(generate(llm, batch, max_tokens=24))
    assert len({tuple(t) for t in plain}) > 1 and all(len(set(t)) > 3 for t in plain)
    with engine(model, {"cpu_bytes": 32 << 20}, async_scheduling=async_scheduling) as llm:
        assert group_kinds(llm) == EXPECTED[preset]
        first, again = run_twice(llm, batch)
        stats = half(llm).stats
        assert first == plain
        assert tokens(again) == plain
        # Every prompt's shared prefix came from kvoffload (the engine forgot it).
        assert all(o.num_cached_tokens >= 6 * BLOCK for o in again)
        # On an idle engine with window groups one load runs at a time (fuzzer seed 276): a
        # later prompt may then find the shared prefix in the prefix cache a load filled.
        assert stats.loads >= 1 and stats.load_failures == 0
        quiescent(llm)


@pytest.mark.parametrize("async_scheduling", MODES, ids=["sync", "async"])
def test_a_hybrid_model_is_served_from_disk(
    gemma3_model: Path, tmp_path: Path, async_scheduling: bool
) -> None:
    """Host memory holds 32 chunks (a prompt's hit needs about 25 over six groups,
    the batch stores over 100): after the engine's prefix cache is reset each prompt,
    asked alone, is served from host memory and the disk tier (tier loads straight into
    the engine's blocks of every group)."""
    batch = prompts(2)
    with engine(gemma3_model, None, async_scheduling=async_scheduling) as llm:
        plain = tokens(generate(llm, batch, max_tokens=24))
    extra = {
        "cpu_bytes": 32 * PAGE,
        "disk_path": str(tmp_path / "disk"),
        "disk_bytes": 2048 * (PAGE + 4096),
    }
    with engine(gemma3_model, extra, async_scheduling=async_scheduling) as llm:
        assert tokens(generate(llm, batch, max_tokens=24)) == plain
        settle(llm)
        again = []
        for prompt in batch:
            llm.reset_prefix_cache()
            again.extend(generate(llm, [prompt], max_tokens=24))
            settle(llm)
        assert tokens(again) == plain
        assert all(o.num_cached_tokens >= 6 * BLOCK for o in again)
        assert counted(llm, "transferred_chunks_total", direction="load", tier="disk") > 0
        assert counted(llm, "failed_chunks_total", direction="load", tier="disk") == 0
        assert counted(llm, "integrity_errors_total", tier="disk", reason="group") == 0
        quiescent(llm)
    # Every chunk on disk names its KV cache group; the groups' chunks all verify.
    report = inspect_disk(tmp_path / "disk", None, verify=True, world_size=None)
    (ns,) = report.namespaces
    assert ns.bad_total == 0 and list(ns.chunks_per_group) == list(range(6))
    assert sum(ns.chunks_per_group.values()) == ns.complete_chunks
    assert all(n > 0 for n in ns.chunks_per_group.values())


def test_the_window_groups_loaded_kv_is_really_used(
    gemma3_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Garbage in only the window groups' host chunks shows in the output: their KV
    is loaded and read, not recomputed (and the clean reload matches)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from kvoffload.core.scheduler import group_chunks, load_jobs

    planned: list[group_chunks.Entry] = []

    def record(*args: Any, **kwargs: Any) -> list[group_chunks.Entry]:
        entries = group_chunks.load_entries(*args, **kwargs)
        planned.extend(entries)
        return entries

    monkeypatch.setattr(load_jobs, "load_entries", record)
    prompt = prompts(3)[0]
    with engine(gemma3_model, {"cpu_bytes": 32 << 20}, async_scheduling=False) as llm:
        clean = generate(llm, [prompt], max_tokens=16, logprobs=1)[0]
        settle(llm)
        llm.reset_prefix_cache()
        reloaded = generate(llm, [prompt], max_tokens=16, logprobs=1)[0]
        settle(llm)
        groups = half(llm).config.kv_groups
        window = [e for e in planned if not groups.groups[e.group].full]
        assert window and len(window) < len(planned)  # both kinds were loaded
        slab = get_kv_transfer_group().worker_side.worker.slab
        for entry in window:
            slot = half(llm).directory.slot_of(entry.key)
            assert slot is not None
            slab.slot_tensor(slot).fill_(7)
        llm.reset_prefix_cache()
        corrupted = generate(llm, [prompt], max_tokens=16, logprobs=1)[0]
        assert reloaded.num_cached_tokens >= 6 * BLOCK
        assert corrupted.num_cached_tokens == reloaded.num_cached_tokens

    def first_logprob(out: Any) -> float:
        step = out.outputs[0].logprobs[0]
        return float(step[out.outputs[0].token_ids[0]].logprob)

    assert first_logprob(reloaded) == pytest.approx(first_logprob(clean), abs=1e-5)
    assert first_logprob(corrupted) != pytest.approx(first_logprob(clean), abs=1e-3)
