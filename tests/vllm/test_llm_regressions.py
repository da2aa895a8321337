"""The vLLM fuzzer issue's bugs on a real in-process ``vllm.LLM`` (float32): requests
that skip reading the prefix cache during a promotion, and a connector reset with a
disk tier (sliding-window models, once refused, are served:
``test_hybrid_models.py``). Async variants really run
vLLM's AsyncScheduler with a batch queue of two (asserted by ``llm_support``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from llm_support import (
    BLOCK,
    CHUNK_BYTES,
    PROMPTS,
    counted,
    engine,
    generate,
    quiescent,
    settle,
)

MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]


def disk_config(tmp_path: Path, host_chunks: int = 8) -> dict[str, Any]:
    """Host memory of ``host_chunks`` chunks above a disk tier of 256."""
    return {
        "cpu_bytes": host_chunks * CHUNK_BYTES,
        "disk_path": str(tmp_path / "disk"),
        "disk_bytes": 256 * (CHUNK_BYTES + 8192),
    }


def run(llm: Any, prompts: list[list[int]], params: list[Any]) -> list[Any]:
    from vllm.inputs import TokensPrompt

    return list(
        llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    )


def params(max_tokens: int = 8, prompt_logprobs: int | None = None) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=prompt_logprobs
    )


def prompt_logprob_values(output: Any) -> list[float]:
    return [float(next(iter(step.values())).logprob) for step in output.prompt_logprobs if step]


def step_until(llm: Any, done: Any, limit: int = 500) -> dict[str, Any]:
    """Step the engine by hand until ``done()``; the finished outputs by request id."""
    finished: dict[str, Any] = {}
    for _ in range(limit):
        if done():
            return finished
        for out in llm.llm_engine.step():
            if out.finished:
                finished[out.request_id] = out
    raise AssertionError("the engine did not get there")


@pytest.mark.parametrize("async_scheduling", MODES)
def test_a_prompt_logprobs_request_admitted_during_its_promotion_is_tracked(
    tiny_model: Path, tmp_path: Path, async_scheduling: bool
) -> None:
    """vLLM admits requests with prompt logprobs (they skip reading the prefix cache)
    whatever kvoffload answered. One looked up while the engine had no blocks for it
    had a promotion planned; admitted while that ran, it was not tracked, and its
    stores put chunks at the wrong positions. Promotions are held here until the
    request is admitted (``GatedTiers``), the way a slow disk holds them."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    from kvoffload.testing.vllm_harness import GatedTiers

    doc, tail = PROMPTS[0], PROMPTS[1][:40]
    hog = [(19 * i) % 977 + 3 for i in range(24 * BLOCK)]  # leaves c no room
    batch = [(hog, params(max_tokens=64)), (doc + tail, params(prompt_logprobs=1))]
    with engine(tiny_model, None, kv_blocks=33, async_scheduling=async_scheduling) as llm:
        want = run(llm, [p for p, _ in batch], [q for _, q in batch])
        later = run(llm, [doc + tail + [9]], [params()])[0]
    fillers = [[(23 * i + 5 * f) % 971 + 9 for i in range(8 * BLOCK)] for f in range(6)]
    config = disk_config(tmp_path, host_chunks=48)  # room for hog's stores and c's promotion
    config["lower_tier_loads"] = "promote"  # the promotion path (tier loads never defer)
    with engine(tiny_model, config, kv_blocks=33, async_scheduling=async_scheduling) as llm:
        for p in [doc, *fillers]:
            generate(llm, [p])
            settle(llm)
        llm.reset_prefix_cache()  # doc's chunks are on the disk only
        worker = get_kv_transfer_group().worker_side
        assert worker.runner is not None
        backend = worker.runner.backend
        gated = GatedTiers(backend.tiers)
        backend.tiers = gated
        ids = [
            llm.llm_engine.add_request(str(i), TokensPrompt(prompt_token_ids=p), q)
            for i, (p, q) in enumerate(batch)
        ]
        core = llm.llm_engine.engine_core.engine_core.scheduler

        def c_admitted() -> bool:  # hog done, or c scheduled: c was looked up meanwhile
            return ids[0] not in core.requests or core.requests[ids[1]].num_computed_tokens > 0

        finished = step_until(llm, c_admitted)
        assert ids[1] in core.requests and gated.held  # promotions (hog's spills) held
        gated.release(set(gated.held))
        backend.tiers = gated.inner
        finished |= step_until(llm, lambda: not core.has_unfinished_requests())
        settle(llm)
        for p in fillers:
            generate(llm, [p])
            settle(llm)
        llm.reset_prefix_cache()
        again = run(llm, [doc + tail + [9]], [params()])[0]
        settle(llm)
        quiescent(llm)  # no request was untracked (an anomaly), no invariant broken
    got = [finished[str(i)] for i in range(2)]
    assert [list(o.outputs[0].token_ids) for o in got] == [
        list(w.outputs[0].token_ids) for w in want
    ]
    assert prompt_logprob_values(got[1]) == pytest.approx(prompt_logprob_values(want[1]), abs=1e-4)
    assert again.num_cached_tokens >= len(doc)  # served what the tracked request stored
    assert list(again.outputs[0].token_ids) == list(later.outputs[0].token_ids)


@pytest.mark.parametrize("async_scheduling", MODES)
def test_a_connector_reset_leaves_nothing_readable_in_host_memory_or_on_disk(
    tiny_model: Path, tmp_path: Path, async_scheduling: bool
) -> None:
    """reset_prefix_cache(reset_connector=True) is vLLM's path when weights change;
    the disk tier used to serve 288 of 300 tokens computed with the old weights."""
    prompt = [(11 * i) % 997 + 3 for i in range(300)]
    other = [(13 * i) % 991 + 5 for i in range(8 * BLOCK)]
    config = disk_config(tmp_path, host_chunks=16)
    with engine(tiny_model, config, async_scheduling=async_scheduling) as llm:
        for p in [prompt, *PROMPTS[1:]]:  # prompt's chunks: on the disk only
            generate(llm, [p])
            settle(llm)
        llm.reset_prefix_cache()  # the engine's own cache only: kvoffload serves it
        assert generate(llm, [prompt])[0].num_cached_tokens == 9 * BLOCK
        settle(llm)
        assert counted(llm, "transferred_chunks_total", direction="load", tier="disk") >= 9
        late = [(17 * i) % 983 + 7 for i in range(8 * BLOCK + 24)]
        generate(llm, [late], max_tokens=9)  # chunk 9 fills in its last step: stored after
        assert llm.reset_prefix_cache(reset_connector=True)
        stored = counted(llm, "transferred_chunks_total", direction="store", tier="host")
        found = counted(llm, "hit_tokens_total", tier="disk")
        generate(llm, [other])
        settle(llm)
        now = counted(llm, "transferred_chunks_total", direction="store", tier="host")
        assert now - stored == 8  # other's chunks, nothing older
        llm.reset_prefix_cache()
        assert generate(llm, [prompt])[0].num_cached_tokens == 0
        settle(llm)
        assert counted(llm, "hit_tokens_total", tier="disk") == found
        quiescent(llm)
