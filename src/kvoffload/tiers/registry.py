"""Every lower tier kvoffload has, below host memory, in the order they sit: one
line per tier. Adding a tier is its own module (a :class:`~kvoffload.tiers.spec.TierSpec`),
its tests and its line here; the config, the adapter, the start-up lines, the events,
the request controls, the simulator and ``kvoffload inspect`` read the specs.

Importing the registry imports no tier's dependencies (see ``tiers/spec.py``), so
``core/`` may read the tiers' config sections from it.
"""

from __future__ import annotations

from kvoffload.core.errors import ConfigError
from kvoffload.tiers.disk_tier import DISK
from kvoffload.tiers.redis_tier import REDIS
from kvoffload.tiers.spec import TierSpec

TIERS: tuple[TierSpec, ...] = (DISK, REDIS)


def tier_names() -> tuple[str, ...]:
    """The lower tiers' names, in order (disk before the shared tiers)."""
    return tuple(spec.name for spec in TIERS)


def tier_spec(name: str) -> TierSpec:
    """The spec of the tier ``name``; ``ConfigError`` naming the known ones."""
    for spec in TIERS:
        if spec.name == name:
            return spec
    raise ConfigError("tier", f"unknown tier {name!r}; known: {', '.join(tier_names())}")
