"""kvoffload inside a real in-process ``vllm.LLM`` (float32, tiny random Llama)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from llm_support import BLOCK, counted, generate, half
from llm_support import engine as llm_engine


@contextmanager
def engine(
    model: Path,
    *,
    offload: bool,
    async_scheduling: bool = False,
    kv_blocks: int = 256,
    extra: dict[str, Any] | None = None,
) -> Iterator[Any]:
    """An engine of ``kv_blocks`` blocks, 8 sequences, with kvoffload (64 MiB host
    memory plus ``extra``) or without."""
    config = {"cpu_bytes": 64 << 20, **(extra or {})} if offload else None
    with llm_engine(
        model, config, kv_blocks=kv_blocks, max_num_seqs=8, async_scheduling=async_scheduling
    ) as llm:
        yield llm


def workload(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 1000) for _ in range(192)] for _ in range(4)]
    return [
        rng.choice(prefixes) + [rng.randrange(3, 1000) for _ in range(rng.randint(10, 200))]
        for _ in range(24)
    ]


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_outputs_identical_with_and_without_kvoffload_under_preemption(
    tiny_model: Path, async_scheduling: bool
) -> None:
    prompts = workload()
    with engine(tiny_model, offload=False, async_scheduling=async_scheduling, kv_blocks=48) as llm:
        plain = [o.outputs[0].token_ids for o in generate(llm, prompts, max_tokens=32)]
    with engine(tiny_model, offload=True, async_scheduling=async_scheduling, kv_blocks=48) as llm:
        outs = generate(llm, prompts, max_tokens=32)
        offloaded = [o.outputs[0].token_ids for o in outs]
        stats = half(llm).stats
        preemptions = counted(llm, "preemptions_total")
    assert offloaded == plain
    assert preemptions > 0  # the engine KV cache was small enough
    assert stats.loads > 0 and stats.stores > 0  # kvoffload really served part of it
    assert stats.load_failures == 0 and stats.store_failures == 0


def test_a_repeated_prompt_is_served_from_kvoffload_after_a_prefix_cache_reset(
    tiny_model: Path,
) -> None:
    prompt = list(range(3, 3 + 8 * BLOCK))
    with engine(tiny_model, offload=True) as llm:
        first = generate(llm, [prompt], max_tokens=16)[0]
        assert first.num_cached_tokens == 0
        llm.reset_prefix_cache()
        again = generate(llm, [prompt], max_tokens=16)[0]
        assert again.num_cached_tokens == len(prompt)
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        assert counted(llm, "transferred_chunks_total", direction="load", tier="host") == 8


def test_corrupting_the_host_copy_changes_logprobs(tiny_model: Path) -> None:
    """The loaded KV is really used: garbage in the host slab shows in the output."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    prompt = list(range(5, 5 + 8 * BLOCK))
    with engine(tiny_model, offload=True) as llm:
        clean = generate(llm, [prompt], max_tokens=16, logprobs=1)[0]
        llm.reset_prefix_cache()
        reloaded = generate(llm, [prompt], max_tokens=16, logprobs=1)[0]
        assert reloaded.num_cached_tokens == len(prompt)
        llm.reset_prefix_cache()
        slab = get_kv_transfer_group().worker_side.worker.slab
        slab.data.copy_(slab.data.flip(0))  # every slot now holds another chunk's bytes
        corrupted = generate(llm, [prompt], max_tokens=16, logprobs=1)[0]
        assert corrupted.num_cached_tokens == len(prompt)

    def first_logprob(out: Any) -> float:
        step = out.outputs[0].logprobs[0]
        return float(step[out.outputs[0].token_ids[0]].logprob)

    assert first_logprob(reloaded) == pytest.approx(first_logprob(clean), abs=1e-5)
    assert first_logprob(corrupted) != pytest.approx(first_logprob(clean), abs=1e-3)


@pytest.mark.parametrize(
    "extra, message",
    [
        ({"evicton": "lru"}, "evicton.*valid keys"),
        ({"store_threshold": 0}, "store_threshold.*integer >= 1"),
        ({"cpu_bytes": -1}, "cpu_bytes"),
    ],
)
def test_bad_extra_config_fails_at_start(
    tiny_model: Path, extra: dict[str, Any], message: str
) -> None:
    with pytest.raises(Exception, match=message), engine(tiny_model, offload=True, extra=extra):
        pass
