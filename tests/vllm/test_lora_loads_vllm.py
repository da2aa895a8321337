"""LoRA adapters are identified by what vLLM loaded, not by their files (decision 0025),
in real in-process vLLM engines (float32, greedy).

The files of a loaded adapter are rewritten in place: vLLM keeps computing with the
adapter it loaded, so kvoffload keeps keying its requests with that adapter; when vLLM
loads the id anew from the rewritten files (evicted from its LRU cache by another
adapter, then needed again) kvoffload serves none of the old KV and stores nothing for
that id. A restart with the new files answers exactly as an engine without kvoffload
with the new adapter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llm_support import PROMPTS, counted, disk_config, engine, settle, tokens
from test_weights_identity_vllm import disk_hits, write_adapter

LORA = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 1, "max_cpu_loras": 1}


def lora_generate(
    llm: Any, adapter: Path, prompts: list[list[int]], lora_id: int = 1
) -> list[list[int]]:
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    request = LoRARequest(f"adapter-{lora_id}", lora_id, str(adapter))
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    return tokens(llm.generate(inputs, params, lora_request=request, use_tqdm=False))


def test_a_restart_after_an_in_place_lora_rewrite_answers_as_no_offload_with_the_new_adapter(
    tiny_model: Path, tmp_path: Path
) -> None:
    adapter, other = tmp_path / "adapter", tmp_path / "other"
    first, later = PROMPTS[:2], PROMPTS[2:]
    write_adapter(adapter, 0.5)  # A
    write_adapter(other, 2.0)
    with engine(tiny_model, disk_config(tmp_path), **LORA) as llm:
        with_a = lora_generate(llm, adapter, first)
        settle(llm)
        write_adapter(adapter, -0.5)  # B, in place, while vLLM holds A
        # vLLM still computes with A: kvoffload serves A's chunks and keys new ones as A's.
        assert lora_generate(llm, adapter, first) == with_a
        lora_generate(llm, adapter, later)
        settle(llm)
        assert counted(llm, "anomalies_total", kind="lora_changed") == 0
        # Another adapter evicts A from vLLM's LRU cache (one CPU slot); the next
        # request of id 1 makes vLLM load it anew, from B's files. vLLM's own prefix
        # cache is reset first (it keys adapters by name and path, not content).
        lora_generate(llm, other, later, lora_id=2)
        llm.reset_prefix_cache()
        with_b = lora_generate(llm, adapter, first)  # A's chunks are in host memory
        settle(llm)
        assert counted(llm, "anomalies_total", kind="lora_changed") == 1
        assert counted(llm, "fenced_jobs_total", direction="load") >= 1
    with engine(tiny_model, None, **LORA) as ref:
        want = lora_generate(ref, adapter, first + later)
    assert with_b == want[:2] and with_b != with_a
    with engine(tiny_model, disk_config(tmp_path), **LORA) as llm:
        assert lora_generate(llm, adapter, first + later) == want
        settle(llm)
        assert disk_hits(llm) == 0  # nothing computed with A was stored as B's
