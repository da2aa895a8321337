"""The settings of one simulation (:class:`SimConfig`) and what they imply: chunk
bytes, slots per tier, the engine's blocks and what one request may hold.

With one full-attention KV cache group (the default) the engine has
``engine_tokens // block_size`` blocks and a chunk is ``chunk_tokens *
bytes_per_token`` bytes. With ``kv_groups`` (a hybrid model,
:mod:`kvoffload.simulate.groups`) the same memory is that many blocks per group,
shared (one is the null block), and each group's chunk is ``1/G`` of those bytes
(a group holds ``1/G`` of the layers).

Each tier has a chunk codec (``codecs``, :mod:`kvoffload.simulate.codecs`; ``none`` by
default): a tier of ``B`` bytes holds ``floor(B / encoded chunk bytes)`` chunks, so
sizes stay raw bytes (``--cpu-bytes 5%`` is the raw bytes of 5% of the distinct
chunks) and a codec shows as more chunks in them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace

from kvoffload.core.config.capacity import slots_per_rank
from kvoffload.core.config.options import default
from kvoffload.core.config.typed import OffloadConfig
from kvoffload.core.errors import UsageError
from kvoffload.core.kv_groups import ONE_GROUP, KVGroups
from kvoffload.simulate.codecs import LOSSLESS, NONE, CodecModel, TierCodec
from kvoffload.simulate.cost import CostModel
from kvoffload.simulate.groups import describe, request_blocks, request_capacity
from kvoffload.tiers.registry import TIERS, lower_tier_names, tier_names


@dataclass(frozen=True)
class SimConfig:
    """Everything one simulation needs besides the workload; validated at
    construction (ConfigError for kvoffload options, UsageError for the rest)."""

    cpu_bytes: int
    # each lower tier's capacity by name (``--<tier>-bytes``; a tier not named: 0, off)
    tier_bytes: Mapping[str, int] = field(default_factory=dict, hash=False)
    eviction: str = default("eviction")
    store_threshold: int = default("store_threshold")
    lower_tier_admission: str | int = default("lower_tier_admission")
    lower_tier_loads: str = default("lower_tier_loads")
    load_policy: str = default("load_policy")
    engine_tokens: int = 262144
    block_size: int = 64
    chunk_tokens: int = 256
    token_budget: int = 8192
    max_running: int = 128
    decode_stride: int = 128
    max_queue: int = 256
    prefix_caching: bool = True
    max_deferral_steps: int = default("max_deferral_steps")
    max_deferral_seconds: float = default("max_deferral_seconds")
    cost: CostModel = field(default_factory=CostModel)
    kv_groups: KVGroups = ONE_GROUP
    # each tier's chunk codec by name (``--<tier>-codec``; a tier not named: none)
    codecs: Mapping[str, str] = field(default_factory=dict, hash=False)
    codec: CodecModel = field(default_factory=CodecModel)

    def __post_init__(self) -> None:
        for name in ("block_size", "token_budget", "max_running", "decode_stride", "max_queue"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UsageError(f"--{name.replace('_', '-')}: must be an integer >= 1")
        unknown = sorted(set(self.tier_bytes) - set(lower_tier_names()))
        if unknown:
            raise UsageError(f"--{unknown[0]}-bytes: no such tier")
        object.__setattr__(
            self, "tier_bytes", {name: self.tier_bytes.get(name, 0) for name in lower_tier_names()}
        )
        sizes = {"cpu_bytes": self.cpu_bytes}
        sizes.update({f"{name}_bytes": size for name, size in self.tier_bytes.items()})
        for name, size in sizes.items():
            if size < 0:
                raise UsageError(f"--{name.replace('_', '-')}: must be >= 0")
        if self.cost.bytes_per_token < len(self.kv_groups):
            raise UsageError("--bytes-per-token: must be at least one byte per KV cache group")
        if self.engine_tokens < self.block_size:
            raise UsageError(f"--engine-tokens: must hold at least one block ({self.block_size})")
        # kvoffload's own validation of its options (names the key, lists accepted values)
        OffloadConfig(
            cpu_bytes=max(1, self.cpu_bytes),
            chunk_tokens=self.chunk_tokens,
            eviction=self.eviction,
            store_threshold=self.store_threshold,
            lower_tier_admission=self.lower_tier_admission,
            lower_tier_loads=self.lower_tier_loads,
            load_policy=self.load_policy,
            max_deferral_steps=self.max_deferral_steps,
            max_deferral_seconds=self.max_deferral_seconds,
        ).resolve_chunk_tokens(self.block_size)
        unknown = sorted(set(self.codecs) - set(tier_names()))
        if unknown:
            raise UsageError(f"--{unknown[0]}-codec: no such tier")
        object.__setattr__(
            self, "codecs", {name: self.codecs.get(name, NONE) for name in tier_names()}
        )
        _ = self.tier_codecs  # refuses a codec that does not apply (fp8 of 8-bit KV)
        used = set(self.codecs.values())
        if self.codec.ratio is not None and LOSSLESS not in used:
            raise UsageError("--codec-ratio: only the lossless codec has a ratio; no tier uses it")
        for name in ("encode_gbps", "decode_gbps"):
            if getattr(self.codec, name) is not None and used == {NONE}:
                raise UsageError(f"--codec-{name.replace('_', '-')}: no tier has a codec")
        if any(self.tier_slots.values()) and not self.host_slots:
            raise UsageError("lower tiers sit below host memory: --cpu-bytes must hold a chunk")

    @property
    def chunk_bytes(self) -> int:
        """Raw bytes of one group's chunk (of the chunk with one group), before any
        codec: what sizes given in chunks or shares count in."""
        return self.chunk_tokens * self.cost.bytes_per_token // len(self.kv_groups)

    @property
    def tier_codecs(self) -> dict[str, TierCodec]:
        """Each tier's codec (host memory's first) applied to a chunk of
        :attr:`chunk_bytes`: its encoded bytes and coding speeds. UsageError naming
        ``--<tier>-codec`` for a codec that does not apply (fp8 of 8-bit KV)."""
        return {
            spec.name: self.codec.tier_codec(
                self.codecs.get(spec.name, NONE),
                self.chunk_bytes,
                f"--{spec.name}-codec",
                slotted=not spec.sim.keyed,
            )
            for spec in TIERS
        }

    @property
    def host_slots(self) -> int:
        """Host slots ``cpu_bytes`` holds (one engine, one rank; 0: off): whole
        chunks encoded by the host's codec."""
        return slots_per_rank(self.cpu_bytes, self.tier_codecs["host"].chunk_bytes)

    @property
    def tier_slots(self) -> dict[str, int]:
        """Each lower tier's capacity in chunks encoded by its codec (0: off)."""
        codecs = self.tier_codecs
        return {name: size // codecs[name].chunk_bytes for name, size in self.tier_bytes.items()}

    @property
    def has_lower_tier(self) -> bool:
        return any(self.tier_bytes.values())

    def without_tiers(self) -> SimConfig:
        """These settings with no kvoffload (no host memory, no lower tier)."""
        return replace(self, cpu_bytes=0, tier_bytes={})

    @property
    def num_blocks(self) -> int:
        """The engine's blocks (every group's, the null block included)."""
        return self.engine_tokens // self.block_size * len(self.kv_groups)

    @property
    def hybrid(self) -> bool:
        """Not the one full-attention group: the engine keeps per-group tables."""
        return not self.kv_groups.plain

    def request_blocks(self, tokens: int) -> int:
        """The most blocks a request of ``tokens`` tokens (prompt and output) holds."""
        if not self.hybrid:
            return -(-tokens // self.block_size)
        return request_blocks(self.kv_groups, tokens, self.block_size, self.token_budget)

    @property
    def request_capacity(self) -> int | None:
        """The longest request the engine can hold (None: any length)."""
        if not self.hybrid:
            return self.num_blocks * self.block_size
        blocks = self.num_blocks - 1  # the null block
        return request_capacity(self.kv_groups, blocks, self.block_size, self.token_budget)

    def too_large(self, tokens: int) -> str | None:
        """Why a request of ``tokens`` tokens cannot run (None: it can)."""
        capacity = self.request_capacity
        if capacity is None or tokens <= capacity:
            return None
        if not self.hybrid:
            return (
                f"the request needs {tokens} tokens of KV, more than the engine holds "
                f"({self.engine_tokens})"
            )
        return (
            f"the request needs {tokens} tokens of KV, more than the engine holds for one "
            f"request ({capacity} with --kv-groups {describe(self.kv_groups)})"
        )

    def settings(self) -> dict[str, object]:
        out: dict[str, object] = {}
        for key, value in asdict(self).items():
            if key == "tier_bytes":  # each tier's capacity as ``<tier>_bytes``
                out.update({f"{name}_bytes": size for name, size in self.tier_bytes.items()})
            else:
                out[key] = value
        del out["cost"]
        del out["kv_groups"]
        del out["codecs"]
        del out["codec"]
        out.update({f"{name}_codec": codec for name, codec in self.codecs.items()})
        c = self.codec
        out.update(
            kv_dtype_bytes=c.kv_dtype_bytes,
            fp8_device=c.fp8_device,
            codec_ratio=c.ratio,
            codec_encode_gbps=c.encode_gbps,
            codec_decode_gbps=c.decode_gbps,
        )
        if self.hybrid:
            out["kv_groups"] = describe(self.kv_groups)
        return out
