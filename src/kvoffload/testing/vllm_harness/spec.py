"""What a harness run is made of: vLLM's configs for a real scheduler, built locally.

:class:`HarnessSpec` names everything a run varies (scheduler kind, KV cache size and
spec, parallel ranks, kvoffload's ``kv_connector_extra_config``);
:func:`build_configs` turns it into the ``VllmConfig`` and ``KVCacheConfig`` vLLM's
``Scheduler`` and kvoffload's connectors are built from. The model directory only
provides ``config.json``: the harness's model is a fake (see ``kv_model.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)

from kvoffload.testing.vllm_cpu import keep_async_scheduling

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
HEADS = 2
HEAD_SIZE = 4
MAX_MODEL_LEN = 2048


@dataclass(frozen=True)
class HarnessSpec:
    """One engine; kvoffload's ``kv_connector_extra_config`` is ``cpu_bytes`` plus ``extra``."""

    async_scheduling: bool = False
    num_blocks: int = 32
    block_size: int = 16
    world_size: int = 1  # tensor-parallel workers, each with its own KV tensors
    sliding_window: int | None = None  # a window: every layer is sliding-window attention
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 64
    cpu_bytes: int = 1 << 20
    extra: dict[str, Any] = field(default_factory=dict)

    def kv_spec(self) -> AttentionSpec:
        if self.sliding_window is not None:
            return SlidingWindowSpec(
                block_size=self.block_size,
                num_kv_heads=HEADS,
                head_size=HEAD_SIZE,
                dtype=torch.float32,
                sliding_window=self.sliding_window,
            )
        return FullAttentionSpec(
            block_size=self.block_size, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32
        )


def build_configs(spec: HarnessSpec, model_path: Path) -> tuple[VllmConfig, KVCacheConfig]:
    """vLLM's configs for ``spec``; async scheduling is kept on (a batch queue of two,
    as a real engine on a GPU has it), whatever vLLM's CPU platform prefers."""
    if spec.async_scheduling:
        keep_async_scheduling()
    kv_spec = spec.kv_spec()
    page = kv_spec.page_size_bytes
    kv_cache_config = KVCacheConfig(
        num_blocks=spec.num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=page * spec.num_blocks * len(LAYERS),
                layers=list(LAYERS),
                layer_stride=page * spec.num_blocks,
                block_stride=page,
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), kv_spec)],
    )
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=str(model_path),
            dtype="float32",
            max_model_len=MAX_MODEL_LEN,
            skip_tokenizer_init=True,
        ),
        cache_config=CacheConfig(block_size=spec.block_size, enable_prefix_caching=True),
        parallel_config=ParallelConfig(tensor_parallel_size=spec.world_size),
        scheduler_config=SchedulerConfig(
            max_num_seqs=spec.max_num_seqs,
            max_num_batched_tokens=spec.max_num_batched_tokens,
            max_model_len=MAX_MODEL_LEN,
            is_encoder_decoder=False,
            async_scheduling=spec.async_scheduling,
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVOffloadConnector",
            kv_connector_module_path="kvoffload.vllm",
            kv_role="kv_both",
            kv_connector_extra_config={"cpu_bytes": spec.cpu_bytes, **spec.extra},
        ),
    )
    vllm_config.cache_config.num_gpu_blocks = spec.num_blocks
    want = 2 if spec.async_scheduling else 1
    if vllm_config.max_concurrent_batches != want:
        raise RuntimeError(
            f"vLLM config has {vllm_config.max_concurrent_batches} concurrent batches, "
            f"the harness wants {want}"
        )
    return vllm_config, kv_cache_config
