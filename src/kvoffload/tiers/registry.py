"""Every tier kvoffload has, in the order they sit: host memory, then the lower
tiers, one line per tier. Adding a tier is its own module (a
:class:`~kvoffload.tiers.spec.TierSpec`), its tests and its line here; the config, the
adapter, the start-up lines, the events, the request controls, the simulator,
``kvoffload inspect`` and the build (where each tier's directory lives, private or
shared by a node's engines) read the specs.

Importing the registry imports no tier's dependencies (see ``tiers/spec.py``), so
``core/`` may read the tiers' config sections from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvoffload.core.errors import ConfigError
from kvoffload.tiers.disk_tier import DISK
from kvoffload.tiers.host_tier import HOST
from kvoffload.tiers.redis_tier import REDIS
from kvoffload.tiers.spec import TierSpec, TierStore

if TYPE_CHECKING:
    from kvoffload.core.tiering.lower import LowerTier

__all__ = ["HOST", "LOWER_TIERS", "TIERS", "lower_tier_names", "tier_names", "tier_spec"]

LOWER_TIERS: tuple[TierSpec[LowerTier, TierStore], ...] = (DISK, REDIS)
"""The tiers below host memory, in order (disk before the shared tiers)."""

TIERS: tuple[TierSpec[Any, Any], ...] = (HOST, *LOWER_TIERS)
"""Every tier: host memory first."""


def tier_names() -> tuple[str, ...]:
    """Every tier's name, in order (``"host"`` first)."""
    return tuple(spec.name for spec in TIERS)


def lower_tier_names() -> tuple[str, ...]:
    """The lower tiers' names, in order."""
    return tuple(spec.name for spec in LOWER_TIERS)


def tier_spec(name: str) -> TierSpec[Any, Any]:
    """The spec of the tier ``name``; ``ConfigError`` naming the known ones."""
    for spec in TIERS:
        if spec.name == name:
            return spec
    raise ConfigError("tier", f"unknown tier {name!r}; known: {', '.join(tier_names())}")
