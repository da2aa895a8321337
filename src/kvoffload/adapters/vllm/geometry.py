"""What kvoffload derives from vLLM's configuration, identically on both halves.

Both the scheduler and every worker compute the chunk geometry, the number of host
slots and the namespace from the same inputs (``VllmConfig``, ``KVCacheConfig``, the
validated :class:`OffloadConfig`), so the slots the scheduler hands out exist in
every worker's slab. Unsupported setups fail here, at engine start, with a
:class:`ConfigError` that names the reason.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from kvoffload.adapters.vllm.compat import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MLAAttentionSpec,
    VllmConfig,
)
from kvoffload.core.config import OffloadConfig
from kvoffload.core.errors import ConfigError
from kvoffload.core.keys import Namespace
from kvoffload.core.scheduler_types import SchedulerConfig
from kvoffload.tiers.disk import slot_bytes as disk_slot_bytes


@dataclass(frozen=True)
class Geometry:
    block_size: int
    hash_block_size: int
    blocks_per_chunk: int
    world_size: int
    bytes_per_block: int  # one worker's share of one engine block, all layers
    num_blocks: int
    num_slots: int
    namespace: Namespace
    disk_slots: int = 0  # chunks the disk tier holds (0: no disk tier)

    @property
    def chunk_bytes(self) -> int:
        return self.bytes_per_block * self.blocks_per_chunk

    @property
    def host_bytes_per_worker(self) -> int:
        return self.num_slots * self.chunk_bytes

    def scheduler_config(self, config: OffloadConfig) -> SchedulerConfig:
        return SchedulerConfig(
            null_block=NULL_BLOCK,
            block_size=self.block_size,
            blocks_per_chunk=self.blocks_per_chunk,
            world_size=self.world_size,
            hash_block_size=self.hash_block_size,
            max_deferral_steps=config.max_deferral_steps,
            max_deferral_seconds=config.max_deferral_seconds,
        )


NULL_BLOCK = 0
"""vLLM's null block: the placeholder id in block tables (e.g. outside a sliding
window) that never holds a request's KV."""

SUPPORTED_SPECS = (FullAttentionSpec, MLAAttentionSpec)
"""KV cache specs whose block table holds a real block for every computed token
(vLLM's full-attention manager). Exact types: their subclasses manage blocks
otherwise (sliding windows free blocks mid-request, rings reuse one block)."""


def describe_spec(spec: KVCacheSpec) -> str:
    """The spec's type and the fields that make it unsupported, for error messages."""
    extra = [
        f"{name}={getattr(spec, name)}"
        for name in ("sliding_window", "attention_chunk_size")
        if getattr(spec, name, None) is not None
    ]
    return type(spec).__name__ + (f"({', '.join(extra)})" if extra else "")


def check_kv_cache_groups(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> None:
    """Refuse (ConfigError) what kvoffload cannot serve correctly yet: more than one KV
    cache group, or a group whose blocks are not kept for every token (sliding-window,
    chunked-local, ring-buffer or state caches: vLLM puts its null block into their
    block tables and frees blocks mid-request)."""
    groups = kv_cache_config.kv_cache_groups
    specs = [g.kv_cache_spec for g in groups]
    if len(groups) == 1 and type(specs[0]) in SUPPORTED_SPECS:
        return
    model = vllm_config.model_config.model
    raise ConfigError(
        "kv_cache_groups",
        f"kvoffload serves models with one full-attention KV cache group; {model} has "
        f"{', '.join(describe_spec(spec) for spec in specs)}. Sliding-window and hybrid "
        "models are not supported yet: serve this model without kvoffload",
    )


def derive_geometry(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: OffloadConfig
) -> Geometry:
    check_kv_cache_groups(vllm_config, kv_cache_config)
    groups = kv_cache_config.kv_cache_groups
    spec = groups[0].kv_cache_spec
    assert isinstance(spec, FullAttentionSpec)  # checked above
    block_size = spec.block_size
    hash_block_size = kv_cache_config.hash_block_size or block_size
    chunk_tokens = config.resolve_chunk_tokens(block_size)
    if chunk_tokens % hash_block_size:
        raise ConfigError(
            "chunk_tokens",
            f"invalid value {chunk_tokens}; accepted: a multiple of the block hash size "
            f"{hash_block_size}",
        )
    num_blocks = kv_cache_config.num_blocks
    bytes_per_block = spec.page_size_bytes * len(groups[0].layer_names)
    parallel = vllm_config.parallel_config
    world_size = parallel.tensor_parallel_size * parallel.pipeline_parallel_size
    blocks_per_chunk = chunk_tokens // block_size
    chunk_bytes = bytes_per_block * blocks_per_chunk
    num_slots = (config.cpu_bytes // world_size) // chunk_bytes if chunk_bytes else 0
    if num_slots < 1:
        raise ConfigError(
            "cpu_bytes",
            f"invalid value {config.cpu_bytes}; accepted: at least one chunk per worker, "
            f"{chunk_bytes * world_size} bytes here ({world_size} workers x {chunk_bytes})",
        )
    layers = sorted(groups[0].layer_names)
    layout = hashlib.blake2b(
        repr(
            (
                type(spec).__name__,
                block_size,
                getattr(spec, "num_kv_heads", None),
                getattr(spec, "head_size", None),
                str(spec.dtype),
                spec.page_size_bytes,
                layers,
                bytes_per_block,
            )
        ).encode(),
        digest_size=12,
    ).hexdigest()
    disk_slots = 0
    if config.disk_bytes is not None:
        file_bytes = disk_slot_bytes(chunk_bytes)
        disk_slots = config.disk_bytes // (file_bytes * world_size)
        if disk_slots < 1:
            raise ConfigError(
                "disk_bytes",
                f"invalid value {config.disk_bytes}; accepted: at least one chunk file per "
                f"worker, {file_bytes * world_size} bytes here",
            )
    model = vllm_config.model_config
    namespace = Namespace(
        model=f"{model.model}@{model.revision or 'main'}",
        layout=layout,
        dtype=str(spec.dtype),
        parallel=f"tp{parallel.tensor_parallel_size}-pp{parallel.pipeline_parallel_size}",
    )
    return Geometry(
        block_size=block_size,
        hash_block_size=hash_block_size,
        blocks_per_chunk=blocks_per_chunk,
        world_size=world_size,
        bytes_per_block=bytes_per_block,
        num_blocks=num_blocks,
        num_slots=num_slots,
        namespace=namespace,
        disk_slots=disk_slots,
    )
