"""Cache events: which chunks a tier gained or lost.

Emitted by the directory (stored when a store completes, removed when a readable
chunk leaves the tier) and drained with ``take_events()``. The vLLM adapter turns
them into vLLM's KV event types so KV-aware routers see every tier.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvoffload.core.keys import ChunkKey


class EventKind(enum.Enum):
    STORED = "stored"
    REMOVED = "removed"


@dataclass(frozen=True)
class CacheEvent:
    """``keys`` became readable in (STORED) or left (REMOVED) the tier ``tier``."""

    kind: EventKind
    keys: tuple[ChunkKey, ...]
    tier: str
