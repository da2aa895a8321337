"""The simulator's cost model: what compute and copies cost in simulated seconds.

A linear model, stated as assumptions in every report:

- an engine step takes ``prefill_tokens * prefill_s_per_token + decode_tokens *
  decode_s_per_token`` (no batching efficiency, no attention cost growing with the
  context: recomputing a long prefix really costs more than this, so the time saved
  by hits is underestimated);
- a copy of ``n`` bytes occupies its lane for ``n / (gbps * 1e9)`` seconds. Lanes:
  host -> engine (loads) and engine -> host (stores) each at ``host_gbps`` (PCIe is
  full duplex), one lane per lower tier at ``disk_gbps`` / ``redis_gbps`` shared by
  spills and promotions;
- a chunk is ``chunk_tokens * bytes_per_token`` bytes. ``bytes_per_token`` is the KV
  of one token over the whole model: ``2 (K and V) * layers * kv_heads * head_dim *
  dtype bytes`` (Llama-3-8B in fp16: 2 * 32 * 8 * 128 * 2 = 131072).

Defaults describe an 8B model on one H100-class GPU with PCIe Gen4 and an NVMe disk.
Immutable; validated at construction (UsageError naming the option).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from kvoffload.core.errors import UsageError


@dataclass(frozen=True)
class CostModel:
    prefill_s_per_token: float = 5e-5  # 20k tokens/s of prefill
    decode_s_per_token: float = 3e-4  # ~3.3k tokens/s of batched decode
    host_gbps: float = 25.0  # PCIe Gen4 x16, each direction
    disk_gbps: float = 3.0  # one NVMe SSD
    redis_gbps: float = 1.25  # 10 GbE
    bytes_per_token: int = 131072  # Llama-3-8B, fp16

    def __post_init__(self) -> None:
        for name in (
            "prefill_s_per_token",
            "decode_s_per_token",
            "host_gbps",
            "disk_gbps",
            "redis_gbps",
        ):
            value = getattr(self, name)
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
        """Bandwidth of a lane: ``host`` (either direction), ``disk`` or ``redis``."""
        return {"host": self.host_gbps, "disk": self.disk_gbps, "redis": self.redis_gbps}[lane]

    def copy_seconds(self, nbytes: int, lane: str) -> float:
        """Time ``nbytes`` occupy ``lane``."""
        return nbytes / (self.lane_gbps(lane) * 1e9)

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)
