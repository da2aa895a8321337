"""Immutable results of :class:`~kvoffload.core.directory.Directory` (values only)."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvoffload.core.keys import ChunkKey


class LookupStatus(enum.Enum):
    MISS = "miss"
    HIT = "hit"  # readable now
    HIT_PENDING = "hit_pending"  # a store of this chunk is in flight


@dataclass(frozen=True)
class LookupResult:
    statuses: tuple[LookupStatus, ...]
    readable_prefix: int  # number of leading HITs


@dataclass(frozen=True)
class PreparedStore:
    """Outcome of ``prepare_store``.

    ``keys``/``slots``: the chunks to copy now, in input order (already-present and
    refused keys removed). ``evicted``: chunks evicted to make room. ``refused``:
    keys not admitted (looked up fewer than ``store_threshold`` times).
    ``no_room``: not enough evictable chunks; nothing was changed.
    """

    keys: tuple[ChunkKey, ...] = ()
    slots: tuple[int, ...] = ()
    evicted: tuple[ChunkKey, ...] = ()
    refused: tuple[ChunkKey, ...] = ()
    no_room: bool = False
