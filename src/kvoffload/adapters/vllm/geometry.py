"""What kvoffload derives from vLLM's configuration, identically on both halves.

Both the scheduler and every worker compute the chunk geometry, the number of host
slots and the namespace (with the model's identity: :mod:`.identity`, decision 0010)
from the same inputs (``VllmConfig``, ``KVCacheConfig``, the
validated :class:`OffloadConfig`), so the slots the scheduler hands out exist in
every worker's slab. Unsupported setups fail here, at engine start, with a
:class:`ConfigError` that names the reason.

KV cache groups (vLLM's hybrid KV cache manager): every group must be full attention
(``FullAttentionSpec``, ``MLAAttentionSpec``) or a sliding window
(``SlidingWindowSpec``), with one block size, one page size and one layer count
(vLLM's uniform grouping), so a chunk of any group has the same size. Anything else
(Mamba or linear-attention state, chunked local attention, ring buffers, groups of
unequal size) is refused, naming the group and the model.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvoffload.adapters.vllm import identity
from kvoffload.adapters.vllm.compat import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    VllmConfig,
)
from kvoffload.codecs.chunk_codec import stored_bytes
from kvoffload.core.config.capacity import slots_per_rank
from kvoffload.core.config.typed import OffloadConfig
from kvoffload.core.errors import ConfigError
from kvoffload.core.keys import Namespace
from kvoffload.core.kv_groups import ONE_GROUP, KVGroup, KVGroups
from kvoffload.core.scheduler_types import SchedulerConfig
from kvoffload.sealing import policy as seal_policy
from kvoffload.tiers.build import enabled_tiers, tier_slots

logger = logging.getLogger("kvoffload")


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
    # each enabled lower tier's capacity in chunks per rank (0: keyed by chunk)
    tier_slots: Mapping[str, int] = field(default_factory=dict)
    kv_groups: KVGroups = ONE_GROUP
    codec: str = "none"  # how host memory keeps chunks (``codec``, decision 0023)
    kv_dtype_bytes: int = 2
    # each enabled lower tier's codec, where it differs from host memory's
    tier_codecs: Mapping[str, str] = field(default_factory=dict)

    @property
    def raw_chunk_bytes(self) -> int:
        """One worker's share of one chunk as the engine's blocks hold it."""
        return self.bytes_per_block * self.blocks_per_chunk

    @property
    def chunk_bytes(self) -> int:
        """One worker's share of one chunk as host memory keeps it (encoded; a lower
        tier's: :meth:`tier_chunk_bytes`)."""
        return stored_bytes(self.codec, self.raw_chunk_bytes, self.kv_dtype_bytes)

    def tier_codec(self, tier: str) -> str:
        """How tier ``tier`` keeps chunks."""
        return self.tier_codecs.get(tier, self.codec)

    def tier_chunk_bytes(self, tier: str) -> int:
        """One worker's share of one chunk as tier ``tier`` keeps it."""
        return stored_bytes(self.tier_codec(tier), self.raw_chunk_bytes, self.kv_dtype_bytes)

    @property
    def chunk_sizes(self) -> dict[str, int]:
        """:meth:`tier_chunk_bytes` of host memory and every enabled lower tier."""
        return {t: self.tier_chunk_bytes(t) for t in ("host", *self.tier_slots)}

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
            kv_groups=self.kv_groups,
            direct_tier_loads=config.lower_tier_loads == "direct",
            load_policy=config.load_policy,
            prefill_tokens_per_s=float(config.prefill_tokens_per_s),
            one_load_beside_windows=True,  # vLLM's stall (SchedulerConfig)
        )


NULL_BLOCK = 0
"""vLLM's null block: the placeholder id in block tables (e.g. outside a sliding
window) that never holds a request's KV."""

FULL_SPECS = (FullAttentionSpec, MLAAttentionSpec)
"""KV cache specs whose block table holds a real block for every computed token
(vLLM's full-attention manager). Exact types: their subclasses manage blocks
otherwise (chunked local attention frees blocks, rings reuse one block)."""


def describe_spec(spec: KVCacheSpec) -> str:
    """The spec's type and the fields that set it apart, for error messages."""
    extra = [
        f"{name}={getattr(spec, name)}"
        for name in ("sliding_window", "attention_chunk_size")
        if getattr(spec, name, None) is not None
    ]
    return type(spec).__name__ + (f"({', '.join(extra)})" if extra else "")


def kv_groups_of(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> KVGroups:
    """kvoffload's view of the engine's KV cache groups, or ConfigError for a group it
    cannot serve (see the module docstring)."""
    groups = kv_cache_config.kv_cache_groups
    model = vllm_config.model_config.model
    out: list[KVGroup] = []
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        if type(spec) in FULL_SPECS:
            out.append(KVGroup())
        elif type(spec) is SlidingWindowSpec:
            out.append(KVGroup(window=spec.sliding_window + spec.extra_retained_tokens))
        else:
            raise ConfigError(
                "kv_cache_groups",
                f"kvoffload serves full-attention and sliding-window KV cache groups; "
                f"group {index} of {model} is {describe_spec(spec)}: serve this model "
                "without kvoffload",
            )
    first = groups[0]
    shape = (first.kv_cache_spec.block_size, first.kv_cache_spec.page_size_bytes)
    for index, group in enumerate(groups):
        spec = group.kv_cache_spec
        if (spec.block_size, spec.page_size_bytes) != shape or len(group.layer_names) != len(
            first.layer_names
        ):
            raise ConfigError(
                "kv_cache_groups",
                f"{model}: KV cache group {index} ({describe_spec(spec)}, "
                f"{len(group.layer_names)} layers, block {spec.block_size}, page "
                f"{spec.page_size_bytes} B) differs in size from group 0 "
                f"({len(first.layer_names)} layers, block {shape[0]}, page {shape[1]} B); "
                "kvoffload needs groups of one size",
            )
    return KVGroups(tuple(out))


def derive_geometry(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: OffloadConfig
) -> Geometry:
    kv_groups = kv_groups_of(vllm_config, kv_cache_config)
    groups = kv_cache_config.kv_cache_groups
    spec = groups[0].kv_cache_spec
    assert isinstance(spec, AttentionSpec)  # checked above
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
    dtype_bytes = int(getattr(spec.dtype, "itemsize", 2))
    raw_bytes = bytes_per_block * blocks_per_chunk
    codec = chunk_codec_for(config.tier_codec("host"), dtype_bytes)
    chunk_bytes = stored_bytes(codec, raw_bytes, dtype_bytes)
    tier_codecs = {
        spec.name: chunk_codec_for(config.tier_codec(spec.name), dtype_bytes)
        for spec in enabled_tiers(config)
    }
    sizes = {name: stored_bytes(c, raw_bytes, dtype_bytes) for name, c in tier_codecs.items()}
    sizes["host"] = chunk_bytes
    num_slots = slots_per_rank(config.cpu_bytes, chunk_bytes, world_size)
    if num_slots < 1:
        raise ConfigError(
            "cpu_bytes",
            f"invalid value {config.cpu_bytes}; accepted: at least one chunk per worker, "
            f"{chunk_bytes * world_size} bytes here ({world_size} workers x {chunk_bytes})",
        )
    # One group: its layers; several: which layers each group's chunks hold.
    layers = [sorted(g.layer_names) for g in groups]
    layout = hashlib.blake2b(
        repr(
            (
                type(spec).__name__ if kv_groups.single else kv_groups.describe(),
                block_size,
                getattr(spec, "num_kv_heads", None),
                getattr(spec, "head_size", None),
                str(spec.dtype),
                spec.page_size_bytes,
                layers[0] if kv_groups.single else layers,
                bytes_per_block,
            )
        ).encode(),
        digest_size=12,
    ).hexdigest()
    slots = tier_slots(config, sizes, world_size)
    model = vllm_config.model_config
    namespace = Namespace(
        model=f"{model.model}@{model.revision or 'main'}",
        layout=layout,
        # Codecs are part of what a chunk's bytes are: chunks of others are never found.
        dtype=codec_tag(str(spec.dtype), codec, tier_codecs) + sealed_tag(config),
        parallel=f"tp{parallel.tensor_parallel_size}-pp{parallel.pipeline_parallel_size}",
        config=identity.config_digest(vllm_config),
        weights=identity.weights_digest(vllm_config),
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
        tier_slots=slots,
        kv_groups=kv_groups,
        codec=codec,
        kv_dtype_bytes=dtype_bytes,
        tier_codecs={name: c for name, c in tier_codecs.items() if c != codec},
    )


def codec_tag(dtype: str, host: str, lower: Mapping[str, str]) -> str:
    """The namespace's ``dtype``: the KV dtype, then the codecs its tiers keep chunks
    in (``torch.bfloat16+fp8``: every tier; ``torch.bfloat16+host:none,disk:fp8``:
    per tier, enabled tiers only). Engines share chunks only with the same tag."""
    if all(c == host for c in lower.values()):
        return dtype if host == "none" else f"{dtype}+{host}"
    return f"{dtype}+" + ",".join(f"{t}:{c}" for t, c in {"host": host, **lower}.items())


def sealed_tag(config: OffloadConfig) -> str:
    """What the namespace's ``dtype`` adds for sealed tiers (``+sealed:redis``; "" for
    none): sealed and unsealed engines never share keys, so neither reads the other's
    values as corrupt and deletes them (decision 0024). The key is not in it: a
    rotated key still opens what the old one sealed."""
    names = [spec.name for spec in enabled_tiers(config) if seal_policy.sealed(config, spec)]
    return f"+sealed:{','.join(names)}" if names else ""


def chunk_codec_for(codec: str, dtype_bytes: int) -> str:
    """The codec an engine of ``dtype_bytes`` KV runs: ``codec``, or none for fp8 over
    KV that is already 8-bit (logged)."""
    if codec == "fp8" and dtype_bytes == 1:
        logger.warning(
            "kvoffload: codec fp8 asked for, but this engine's KV cache is already 8-bit: "
            "chunks are kept as they are (codec none)"
        )
        return "none"
    return codec
