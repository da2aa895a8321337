"""The simulator's cost model: what compute and copies cost in simulated seconds.

A linear model, stated as assumptions in every report:

- an engine step takes ``prefill_tokens * prefill_s_per_token + decode_tokens *
  decode_s_per_token`` (no batching efficiency, no attention cost growing with the
  context: recomputing a long prefix really costs more than this, so the time saved
  by hits is underestimated);
- a copy of ``n`` bytes occupies its lane for ``n / (gbps * 1e9)`` seconds. Lanes:
  host -> engine (loads) and engine -> host (stores) each at ``host_gbps`` (PCIe is
  full duplex), one lane per lower tier at its ``tier_gbps`` (by default its spec's,
  ``TierSpec.sim``) shared by spills, promotions and tier loads' reads;
- a chunk is ``chunk_tokens * bytes_per_token`` bytes. ``bytes_per_token`` is the KV
  of one token over the whole model: ``2 (K and V) * layers * kv_heads * head_dim *
  dtype bytes`` (Llama-3-8B in fp16: 2 * 32 * 8 * 128 * 2 = 131072).

Defaults describe an 8B model on one H100-class GPU with PCIe Gen4 and an NVMe disk.
Immutable; validated at construction (UsageError naming the option).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace

from kvoffload.core.errors import UsageError
from kvoffload.tiers.registry import HOST, LOWER_TIERS


def default_tier_gbps() -> dict[str, float]:
    """Each lower tier's bandwidth by default (its spec's simulator lane)."""
    return {spec.name: spec.sim.gbps for spec in LOWER_TIERS}


@dataclass(frozen=True)
class CostModel:
    prefill_s_per_token: float = 5e-5  # 20k tokens/s of prefill
    decode_s_per_token: float = 3e-4  # ~3.3k tokens/s of batched decode
    host_gbps: float = HOST.sim.gbps
    bytes_per_token: int = 131072  # Llama-3-8B, fp16
    # per lower tier, GB/s both directions; a tier not named has its default
    tier_gbps: Mapping[str, float] = field(default_factory=default_tier_gbps, hash=False)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.tier_gbps) - set(default_tier_gbps()))
        if unknown:
            raise UsageError(f"--{unknown[0]}-gbps: no such tier")
        object.__setattr__(self, "tier_gbps", {**default_tier_gbps(), **self.tier_gbps})
        values = {
            "prefill_s_per_token": self.prefill_s_per_token,
            "decode_s_per_token": self.decode_s_per_token,
            "host_gbps": self.host_gbps,
            **{f"{name}_gbps": gbps for name, gbps in self.tier_gbps.items()},
        }
        for name, value in values.items():
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise UsageError(f"--{name.replace('_', '-')}: must be a number > 0, got {value}")
        if not isinstance(self.bytes_per_token, int) or self.bytes_per_token < 1:
            raise UsageError(
                f"--bytes-per-token: must be an integer >= 1, got {self.bytes_per_token}"
            )

    def compute_seconds(self, prefill_tokens: int, decode_tokens: int) -> float:
        """Duration of an engine step computing these tokens."""
        return prefill_tokens * self.prefill_s_per_token + decode_tokens * self.decode_s_per_token

    def lane_gbps(self, lane: str) -> float:
        """Bandwidth of a lane: ``host`` (either direction) or a lower tier's name."""
        return self.host_gbps if lane == "host" else self.tier_gbps[lane]

    def copy_seconds(self, nbytes: int, lane: str) -> float:
        """Time ``nbytes`` occupy ``lane``."""
        return nbytes / (self.lane_gbps(lane) * 1e9)

    def as_dict(self) -> dict[str, float | int]:
        """Every setting by name, each tier's bandwidth as ``<tier>_gbps``."""
        out: dict[str, float | int] = {k: v for k, v in asdict(self).items() if k != "tier_gbps"}
        out.update({f"{name}_gbps": gbps for name, gbps in self.tier_gbps.items()})
        return out

    def with_tier_gbps(self, gbps: float) -> CostModel:
        """This model with every lower tier at ``gbps``."""
        return replace(self, tier_gbps={name: gbps for name in self.tier_gbps})
