"""KV computed with other weights is never served (decision 0019), in real in-process
vLLM engines (float32, greedy): weights updated in place while the engine runs
(``collective_rpc``, ``reload_weights``) followed by vLLM's default reset of its
prefix cache; weight files rewritten in place between restarts; LongRoPE at another
``max_model_len``; a LoRA adapter rewritten in place. Each answer is compared with an
engine without kvoffload on the same weights; unchanged weights keep their chunks.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from llm_support import (
    CHUNK_BYTES,
    PROMPTS,
    counted,
    disk_config,
    engine,
    generate,
    settle,
    tier,
    tokens,
)
from safetensors.torch import load_file, save_file

from kvoffload.core.keys import Namespace

PROMPT_TOKENS = 2 * len(PROMPTS[0])  # two prompts of 8 chunks


def host_hits(llm: Any) -> int:
    return counted(llm, "hit_tokens_total", tier="host")


def host_loaded(llm: Any) -> int:
    """Chunks copied from host memory into the engine (planned, less those failed)."""
    planned = counted(llm, "transferred_chunks_total", direction="load", tier="host")
    return planned - counted(llm, "failed_chunks_total", direction="load", tier="host")


def fenced_loads(llm: Any) -> int:
    return counted(llm, "fenced_jobs_total", direction="load")


def disk_hits(llm: Any) -> int:
    return int(tier(llm, "disk").metrics.value("hit_tokens_total"))


def worker(llm: Any) -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().worker_side


def scale_first_norm(self: Any) -> None:
    """Run in the worker by ``collective_rpc``: an in-place update of layer 0 (its
    input norm: on vLLM's CPU build the linear weights are packed out of reach)."""
    with torch.no_grad():
        self.model_runner.model.model.layers[0].input_layernorm.weight.mul_(3.0)


def rewrite_first_attention(model: Path) -> None:
    """Layer 0's ``k_proj`` and ``v_proj`` rewritten in place in the checkpoint: same
    names, shapes, file size and modification time (a partial fine-tune copied over)."""
    path = model / "model.safetensors"
    before = path.stat()
    weights = load_file(path)
    weights["model.layers.0.self_attn.k_proj.weight"] *= 3.0
    weights["model.layers.0.self_attn.v_proj.weight"] *= -2.0
    save_file(weights, path, metadata={"format": "pt"})
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_size == before.st_size


def test_weights_updated_in_place_and_a_default_reset_never_serve_the_old_kv(
    tiny_model: Path, tmp_path: Path
) -> None:
    """RL-style: layer 0 scaled through ``collective_rpc``, then
    ``reset_prefix_cache()`` with vLLM's defaults (the connector is not told). Before
    that, a default reset with unchanged weights keeps every chunk."""
    prompts = PROMPTS[:2]
    with engine(tiny_model, None) as ref:
        ref.collective_rpc(scale_first_norm)
        want = tokens(generate(ref, prompts))
    with engine(tiny_model, {"cpu_bytes": 64 * CHUNK_BYTES}) as llm:
        before = tokens(generate(llm, prompts))
        settle(llm)
        assert llm.reset_prefix_cache()  # weights unchanged: the chunks stay good
        assert tokens(generate(llm, prompts)) == before
        settle(llm)
        assert host_hits(llm) == PROMPT_TOKENS  # every prompt token
        assert counted(llm, "weights_checks_total") == 1
        assert counted(llm, "weights_changes_total") == 0
        loaded = host_loaded(llm)
        assert loaded == 16 and fenced_loads(llm) == 0
        llm.collective_rpc(scale_first_norm)
        assert llm.reset_prefix_cache()
        # The step after the reset fingerprints the weights before its loads run: the
        # two loads it planned under the old keys are refused, the requests recompute.
        outputs = generate(llm, prompts)
        assert tokens(outputs) == want != before  # the new weights' answer
        assert fenced_loads(llm) == 2
        assert host_loaded(llm) == loaded  # nothing copied from before the update
        settle(llm)
        assert counted(llm, "weights_changes_total") == 1
        assert llm.reset_prefix_cache()  # the new weights' chunks are served again
        assert tokens(generate(llm, prompts)) == want
        settle(llm)
        assert host_loaded(llm) == loaded + 16 and fenced_loads(llm) == 2


def test_weights_reloaded_from_rewritten_files_never_serve_the_old_kv(
    tiny_model: Path, tmp_path: Path
) -> None:
    """``reload_weights`` after the checkpoint was rewritten in place (the path vLLM's
    own weight updates take): the fingerprint follows what ``load_weights`` loaded."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    prompts = PROMPTS[:2]
    with engine(model, {"cpu_bytes": 64 * CHUNK_BYTES}) as llm:
        before = tokens(generate(llm, prompts))
        settle(llm)
        fingerprint = worker(llm).weights.fingerprint
        rewrite_first_attention(model)
        llm.collective_rpc("reload_weights")
        assert llm.reset_prefix_cache()
        after = tokens(generate(llm, prompts))
        settle(llm)
        assert host_loaded(llm) == 0 and fenced_loads(llm) == 2  # refused, recomputed
        assert worker(llm).weights.fingerprint != fingerprint
        assert counted(llm, "weights_changes_total") == 1
    with engine(model, None) as ref:
        assert tokens(generate(ref, prompts)) == after != before


def test_weight_files_rewritten_in_place_between_restarts_are_never_served(
    tiny_model: Path, tmp_path: Path
) -> None:
    """Two tensors of layer 0 rewritten in place (size and mtime kept) between two
    lives of an engine with a disk tier: the restarted engine finds nothing."""
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    prompts = PROMPTS[:2]
    with engine(model, disk_config(tmp_path)) as llm:
        before = tokens(generate(llm, prompts))
        settle(llm)
        failed = counted(llm, "failed_chunks_total", direction="spill", tier="disk")
        assert tier(llm, "disk").held_count() == 16, f"{failed} spilled chunks failed"
        old = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side
        first = old.geometry.namespace
    with engine(model, disk_config(tmp_path)) as llm:  # unchanged: served from disk
        assert tokens(generate(llm, prompts)) == before
        settle(llm)
        assert disk_hits(llm) > 0
    rewrite_first_attention(model)
    with engine(model, None) as ref:
        want = tokens(generate(ref, prompts))
    assert want != before  # the rewrite changes the answer: the test means something
    with engine(model, disk_config(tmp_path)) as llm:
        outputs = generate(llm, prompts)
        assert tokens(outputs) == want
        assert disk_hits(llm) == 0
        settle(llm)
        side = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side
        second: Namespace = side.geometry.namespace
    assert second.weights != first.weights and second.config == first.config


def test_longrope_at_another_max_model_len_is_never_served(
    tiny_longrope_model: Path, tmp_path: Path
) -> None:
    """vLLM uses LongRoPE's short factors at ``max_model_len`` <= 256 and the long ones
    above: the same checkpoint and configuration compute other KV."""
    prompts = [p[: 6 * 32] for p in PROMPTS[:2]]  # 6 chunks: prompt and answer fit 256
    short, long = {"max_model_len": 256}, {"max_model_len": 1024}
    with engine(tiny_longrope_model, None, **long) as ref:
        want = tokens(generate(ref, prompts))
    with engine(tiny_longrope_model, disk_config(tmp_path), **short) as llm:
        at_short = tokens(generate(llm, prompts))
        settle(llm)
        short_print = worker(llm).weights.fingerprint
        assert tier(llm, "disk").held_count() == 12
    assert at_short != want  # the factors change the answer: the test means something
    with engine(tiny_longrope_model, disk_config(tmp_path), **long) as llm:
        outputs = generate(llm, prompts)
        assert tokens(outputs) == want
        assert disk_hits(llm) == 0
        settle(llm)
        assert worker(llm).weights.fingerprint != short_print
    with engine(tiny_longrope_model, disk_config(tmp_path), **short) as llm:
        assert tokens(generate(llm, prompts)) == at_short  # its own chunks, still there
        settle(llm)
        assert disk_hits(llm) > 0


def write_adapter(path: Path, scale: float) -> None:
    """A rank-8 LoRA adapter of the tiny Llama's attention projections."""
    path.mkdir(exist_ok=True)
    config = {
        "r": 8,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "bias": "none",
        "peft_type": "LORA",
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(2):
        for module, out in (("q_proj", 128), ("k_proj", 64), ("v_proj", 64), ("o_proj", 128)):
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(8, 128, generator=generator) * 0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, 8, generator=generator) * scale
    save_file(tensors, path / "adapter_model.safetensors")


def lora_generate(llm: Any, adapter: Path, prompts: list[list[int]]) -> list[list[int]]:
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    request = LoRARequest("adapter", 1, str(adapter))  # the same name, id and path
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    return tokens(llm.generate(inputs, params, lora_request=request, use_tqdm=False))


def test_a_lora_adapter_rewritten_in_place_is_never_served_its_old_kv(
    tiny_model: Path, tmp_path: Path
) -> None:
    """vLLM's block hashes name an adapter by name and path; kvoffload's keys also
    carry its content."""
    adapter = tmp_path / "adapter"
    prompts = PROMPTS[:2]
    lora = {"enable_lora": True, "max_lora_rank": 8}
    write_adapter(adapter, 0.5)
    with engine(tiny_model, disk_config(tmp_path), **lora) as llm:
        before = lora_generate(llm, adapter, prompts)
        settle(llm)
    write_adapter(adapter, -0.5)  # retrained in place
    with engine(tiny_model, None, **lora) as ref:
        want = lora_generate(ref, adapter, prompts)
    assert want != before
    with engine(tiny_model, disk_config(tmp_path), **lora) as llm:
        assert lora_generate(llm, adapter, prompts) == want
        settle(llm)
        assert disk_hits(llm) == 0
    write_adapter(adapter, 0.5)  # the first adapter again: its chunks are found
    with engine(tiny_model, disk_config(tmp_path), **lora) as llm:
        assert lora_generate(llm, adapter, prompts) == before
        settle(llm)
        assert disk_hits(llm) > 0
