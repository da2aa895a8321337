"""The scheduler half's view of the tiers below host memory.

A :class:`LowerTier` answers which chunks it holds and books the chunks moving in
(spills) and out (promotions); the bytes move in the workers (``SPILL`` and
``PROMOTE`` jobs, see ``docs/decisions/0004-lower-tiers.md``). Two kinds:

- :class:`DirectoryTier` (disk): authoritative, bounded by its own capacity, with its
  own eviction policy; a promotion pins its sources so they are not evicted while
  being read; eviction victims are handed to the next spill job to delete.
- a remote index (Redis/Valkey, in :mod:`kvoffload.tiers.redis_index`): not
  authoritative (the server evicts, other engines add); ``present_run`` may answer
  None while it asks the server, and a value gone by read time is a miss.

Owned by the scheduler half; no bytes, no I/O in this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvoffload.core.directory import Directory
from kvoffload.core.events import CacheEvent
from kvoffload.core.keys import ChunkKey


@dataclass(frozen=True)
class SpillBooking:
    """What a spill job must do: write ``keys`` after deleting ``drop_keys``."""

    keys: tuple[ChunkKey, ...]
    drop_keys: tuple[ChunkKey, ...] = ()


@dataclass
class TierStats:
    """Counters of one lower tier, mutated by the scheduler half."""

    lookups: int = 0
    hit_chunks: int = 0
    spilled_chunks: int = 0
    spill_failures: int = 0
    spill_no_room: int = 0
    promoted_chunks: int = 0
    promotion_failures: int = 0
    integrity_errors: dict[str, int] = field(default_factory=dict)
    missing: int = 0


class LowerTier(Protocol):
    name: str
    stats: TierStats

    def present_run(self, keys: Sequence[ChunkKey]) -> int | None:
        """How many leading ``keys`` the tier holds; None while it cannot tell yet
        (ask again later). No side effect on the tier's contents."""

    def book_promotion(self, keys: Sequence[ChunkKey]) -> None:
        """``keys`` (all present) are about to be read: keep them until released."""

    def release_promotion(self, keys: Sequence[ChunkKey], bad: Sequence[ChunkKey]) -> None:
        """The read of ``keys`` ended; ``bad`` ones were missing or corrupt: forget them."""

    def book_spill(self, keys: Sequence[ChunkKey]) -> SpillBooking | None:
        """Reserve room for the ``keys`` not held yet; None when there is no room."""

    def complete_spill(self, written: Sequence[ChunkKey], failed: Sequence[ChunkKey]) -> None:
        """The spill job ended: ``written`` are held now, ``failed`` are not."""

    def take_events(self) -> list[CacheEvent]: ...

    def held_count(self) -> int:
        """Chunks the tier is known to hold (for usage reporting)."""


class DirectoryTier:
    """A bounded, authoritative lower tier (the disk), booked in its own directory."""

    def __init__(self, directory: Directory) -> None:
        self.directory = directory
        self.name = directory.tier
        self.stats = TierStats()
        self._to_drop: list[ChunkKey] = []

    def present_run(self, keys: Sequence[ChunkKey]) -> int:
        return self.directory.readable_prefix(keys)

    def book_promotion(self, keys: Sequence[ChunkKey]) -> None:
        self.directory.prepare_load(keys)

    def release_promotion(self, keys: Sequence[ChunkKey], bad: Sequence[ChunkKey]) -> None:
        self.directory.complete_load(keys)
        self.forget(bad)

    def forget(self, keys: Sequence[ChunkKey]) -> None:
        """Drop ``keys`` from the directory; their files go with the next spill."""
        self.directory.discard(keys)
        self._to_drop.extend(keys)

    def book_spill(self, keys: Sequence[ChunkKey]) -> SpillBooking | None:
        prepared = self.directory.prepare_store(keys)
        if prepared.no_room:
            self.stats.spill_no_room += len(keys)
            return None
        drops = (*self._to_drop, *prepared.evicted)
        self._to_drop = []
        return SpillBooking(prepared.keys, drops)

    def complete_spill(self, written: Sequence[ChunkKey], failed: Sequence[ChunkKey]) -> None:
        if written:
            self.directory.complete_store(written, success=True)
        if failed:
            self.directory.complete_store(failed, success=False)
            self._to_drop.extend(failed)  # a partial file of another rank may remain
        self.stats.spilled_chunks += len(written)
        self.stats.spill_failures += len(failed)

    def take_events(self) -> list[CacheEvent]:
        return self.directory.take_events()

    def held_count(self) -> int:
        return len(self.directory)

    def pending_drops(self) -> tuple[ChunkKey, ...]:
        return tuple(self._to_drop)
