"""What a harness run is made of: vLLM's configs for a real scheduler, built locally.

:class:`HarnessSpec` names everything a run varies (scheduler kind, KV cache size,
KV cache groups, parallel ranks, kvoffload's ``kv_connector_extra_config``);
:func:`build_configs` turns it into the ``VllmConfig`` and ``KVCacheConfig`` vLLM's
``Scheduler`` and kvoffload's connectors are built from. The model directory only
provides ``config.json``: the harness's model is a fake (see ``kv_model.py``).

KV cache groups are laid out as vLLM's hybrid KV cache manager lays them out: every
group has :data:`LAYERS_PER_GROUP` layers of one page size, its own layer names
(:func:`layer_names`) and its own ``KVCacheTensor``; all groups' tensors alias from
byte 0, so layer ``i`` of every group is the same memory (a block belongs to one
group at a time). Several groups make vLLM's scheduler use its
``HybridKVCacheCoordinator``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.config import (
    CacheConfig,
    KVEventsConfig,
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
    KVCacheSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)

from kvoffload.core.cost import LaneCosts
from kvoffload.testing.vllm_cpu import keep_async_scheduling

LAYERS_PER_GROUP = 2
HEADS = 2
HEAD_SIZE = 4
MAX_MODEL_LEN = 2048


def layer_names(group: int) -> tuple[str, ...]:
    """Group ``group``'s layer names (group 0: layers 0 and 1, group 1: 2 and 3, ...)."""
    first = group * LAYERS_PER_GROUP
    return tuple(f"model.layers.{first + i}.self_attn.attn" for i in range(LAYERS_PER_GROUP))


LAYERS = layer_names(0)
"""The layers of one group (every group has as many): what one block holds."""


@dataclass(frozen=True)
class HarnessSpec:
    """One engine; kvoffload's ``kv_connector_extra_config`` is ``cpu_bytes`` plus ``extra``.

    ``groups``: the KV cache groups in vLLM's group order, each None (full attention)
    or a sliding window in tokens. ``kv_specs`` replaces the groups' specs outright
    (a test of a group kvoffload cannot serve)."""

    async_scheduling: bool = False
    num_blocks: int = 32
    block_size: int = 16
    world_size: int = 1  # tensor-parallel workers, each with its own KV tensors
    groups: tuple[int | None, ...] = (None,)
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 64
    cpu_bytes: int = 1 << 20
    extra: dict[str, Any] = field(default_factory=dict)
    kv_specs: tuple[KVCacheSpec, ...] | None = None
    beside: dict[str, Any] | None = None
    """Not None: kvoffload runs as the second child of vLLM's ``MultiConnector``,
    after another loading connector (a second kvoffload with this
    ``kv_connector_extra_config``, standing in for a P/D connector): the first child
    with a hit loads, every child stores."""
    kv_events: bool = False
    """vLLM's KV events on (a null publisher; the harness captures what is published,
    and drives the share announcer's rounds itself)."""
    lane_costs: dict[str, LaneCosts] = field(default_factory=dict)
    """The fixed cost of a load on each lane (``host``, ``disk``, ``redis``) the cost
    model learns from, instead of the worker threads' real timings (decision 0013):
    lanes not named cost nothing, so every hit is taken unless a test says otherwise."""

    def __post_init__(self) -> None:
        if not self.groups or any(w is not None and w < 1 for w in self.groups):
            raise ValueError(f"groups {self.groups!r}: at least one, windows positive")

    def group_spec(self, window: int | None) -> AttentionSpec:
        """The KV cache spec of a group with ``window`` (None: full attention)."""
        if window is not None:
            return SlidingWindowSpec(
                block_size=self.block_size,
                num_kv_heads=HEADS,
                head_size=HEAD_SIZE,
                dtype=torch.float32,
                sliding_window=window,
            )
        return FullAttentionSpec(
            block_size=self.block_size, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.float32
        )

    def specs(self) -> tuple[KVCacheSpec, ...]:
        """Every group's KV cache spec, in group order."""
        if self.kv_specs is not None:
            return self.kv_specs
        return tuple(self.group_spec(w) for w in self.groups)


def kv_cache_config(spec: HarnessSpec) -> KVCacheConfig:
    """vLLM's layer-outer layout for ``spec``'s groups (see the module docstring)."""
    specs = spec.specs()
    page = max(s.page_size_bytes for s in specs)
    size = page * spec.num_blocks * LAYERS_PER_GROUP
    tensors = [
        KVCacheTensor(
            size=size,
            layers=list(layer_names(g)),
            layer_stride=page * spec.num_blocks,
            block_stride=page,
        )
        for g in range(len(specs))
    ]
    groups = [KVCacheGroupSpec(list(layer_names(g)), s) for g, s in enumerate(specs)]
    return KVCacheConfig(
        num_blocks=spec.num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups
    )


def transfer_config(spec: HarnessSpec) -> KVTransferConfig:
    """kvoffload's ``kv_transfer_config``, or a ``MultiConnector``'s naming another
    kvoffload first and kvoffload under test second (``spec.beside``). The
    ``MultiConnector`` config is left as a user writes it: its
    ``kv_load_failure_policy`` is vLLM's default, for kvoffload to set."""
    ours: dict[str, Any] = {
        "kv_connector": "KVOffloadConnector",
        "kv_connector_module_path": "kvoffload.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes": spec.cpu_bytes, **spec.extra},
    }
    if spec.beside is None:
        return KVTransferConfig(**ours)
    other = {**ours, "kv_connector_extra_config": dict(spec.beside)}
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": [other, ours]},
    )


def build_configs(spec: HarnessSpec, model_path: Path) -> tuple[VllmConfig, KVCacheConfig]:
    """vLLM's configs for ``spec``; async scheduling is kept on (a batch queue of two,
    as a real engine on a GPU has it), whatever vLLM's CPU platform prefers; the
    hybrid KV cache manager stays on (checked)."""
    if spec.async_scheduling:
        keep_async_scheduling()
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
        kv_transfer_config=transfer_config(spec),
        kv_events_config=(
            KVEventsConfig(enable_kv_cache_events=True, publisher="null")
            if spec.kv_events
            else None
        ),
    )
    vllm_config.cache_config.num_gpu_blocks = spec.num_blocks
    want = 2 if spec.async_scheduling else 1
    if vllm_config.max_concurrent_batches != want:
        raise RuntimeError(
            f"vLLM config has {vllm_config.max_concurrent_batches} concurrent batches, "
            f"the harness wants {want}"
        )
    if vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
        raise RuntimeError("vLLM turned its hybrid KV cache manager off")
    return vllm_config, kv_cache_config(spec)
