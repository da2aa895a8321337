"""How many host slots a memory budget holds: the one computation of it, for the
host tier, the vLLM adapter's geometry, a host share's geometry and the simulator.

``cpu_bytes`` is for all ranks together; one slot holds one rank's part of a chunk
(``chunk_bytes``), so each of ``world_size`` ranks gets ``(cpu_bytes // world_size)
// chunk_bytes`` slots. Pure functions; only :func:`host_slots` raises.
"""

from __future__ import annotations

from kvoffload.core.errors import ConfigError

__all__ = ["host_slots", "slots_per_rank"]


def slots_per_rank(cpu_bytes: int, chunk_bytes: int, world_size: int = 1) -> int:
    """Slots of ``chunk_bytes`` per rank that ``cpu_bytes`` (all ``world_size`` ranks
    together) holds: 0 when not one fits, or when ``chunk_bytes`` is 0. Never raises
    for ``world_size >= 1``."""
    return (cpu_bytes // world_size) // chunk_bytes if chunk_bytes else 0


def host_slots(cpu_bytes: int, chunk_bytes: int, world_size: int) -> int:
    """:func:`slots_per_rank`, at least 1: ``ConfigError`` naming ``cpu_bytes`` (with
    the bytes one chunk per worker needs) when not even one slot fits."""
    count = slots_per_rank(cpu_bytes, chunk_bytes, world_size)
    if count < 1:
        raise ConfigError(
            "cpu_bytes",
            f"invalid value {cpu_bytes}; accepted: at least one chunk per worker, "
            f"{chunk_bytes * world_size} bytes here",
        )
    return count
