"""kvoffload inside a real in-process ``vllm.LLM`` (float32, tiny random Llama)."""

from __future__ import annotations

import gc
import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

BLOCK = 32


@contextmanager
def engine(
    model: Path,
    *,
    offload: bool,
    async_scheduling: bool = False,
    kv_blocks: int = 256,
    extra: dict[str, Any] | None = None,
) -> Iterator[Any]:
    from vllm import LLM

    kv_transfer = None
    if offload:
        kv_transfer = {
            "kv_connector": "KVOffloadConnector",
            "kv_connector_module_path": "kvoffload.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"cpu_bytes": 64 << 20, **(extra or {})},
        }
    # 2 layers x 2 KV heads x 32 tokens x 2 x 32 dims x 4 bytes = 32 KiB per block
    llm = LLM(
        model=str(model),
        skip_tokenizer_init=True,
        max_model_len=1024,
        block_size=BLOCK,
        enforce_eager=True,
        dtype="float32",
        kv_cache_memory_bytes=kv_blocks * 32 * 1024,
        enable_prefix_caching=True,
        max_num_seqs=8,
        seed=0,
        async_scheduling=async_scheduling,
        kv_transfer_config=kv_transfer,
    )
    try:
        yield llm
    finally:
        # Shut this engine down now: collected later, it would tear down the parallel
        # groups of the next engine built in this process.
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        llm.llm_engine.engine_core.shutdown()
        del llm
        cleanup_dist_env_and_memory()
        gc.collect()


def generate(llm: Any, prompts: list[list[int]], max_tokens: int = 16, logprobs: int | None = None):  # type: ignore[no-untyped-def]
    from vllm.inputs import TokensPrompt

    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs
    )
    return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)


def scheduler_half(llm: Any):  # type: ignore[no-untyped-def]
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    return connector.scheduler_side.scheduler


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
        stats = scheduler_half(llm).stats
    assert offloaded == plain
    assert stats.preemptions > 0  # the engine KV cache was small enough
    assert stats.loads > 0 and stats.stores > 0  # kvoffload really served part of it
    assert stats.load_failures == 0 and stats.store_failures == 0


def test_a_repeated_prompt_is_served_from_kvoffload_after_a_prefix_cache_reset(
    tiny_model: Path,
) -> None:
    prompt = list(range(3, 3 + 8 * BLOCK))
    with engine(tiny_model, offload=True) as llm:
        first = generate(llm, [prompt])[0]
        assert first.num_cached_tokens == 0
        llm.reset_prefix_cache()
        again = generate(llm, [prompt])[0]
        assert again.num_cached_tokens == len(prompt)
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        assert scheduler_half(llm).stats.loaded_chunks == 8


def test_corrupting_the_host_copy_changes_logprobs(tiny_model: Path) -> None:
    """The loaded KV is really used: garbage in the host slab shows in the output."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    prompt = list(range(5, 5 + 8 * BLOCK))
    with engine(tiny_model, offload=True) as llm:
        clean = generate(llm, [prompt], logprobs=1)[0]
        llm.reset_prefix_cache()
        reloaded = generate(llm, [prompt], logprobs=1)[0]
        assert reloaded.num_cached_tokens == len(prompt)
        llm.reset_prefix_cache()
        slab = get_kv_transfer_group().worker_side.worker.slab
        slab.data.copy_(slab.data.flip(0))  # every slot now holds another chunk's bytes
        corrupted = generate(llm, [prompt], logprobs=1)[0]
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
