"""The scheduler half's view of the tiers below host memory.

A :class:`LowerTier` answers which chunks it holds and books the chunks moving in
(spills) and out (promotions); the bytes move in the workers (``SPILL`` and
``PROMOTE`` jobs, see ``docs/decisions/0004-lower-tiers.md``). Two kinds:

- :class:`DirectoryTier` (disk): authoritative, bounded by its own capacity, with its
  own eviction policy and slots (a chunk's place in the tier's storage, sent with
  each job); a promotion pins its sources so they are not evicted while being read;
  an evicted chunk's slot is simply written over by the next chunk stored there.
- a remote index (:mod:`kvoffload.tiers.remote_index`; Redis/Valkey's in
  :mod:`kvoffload.tiers.redis_index`): not authoritative (the server evicts, other
  engines add); ``present_run`` may answer None while it asks the server, and a value
  gone by read time is a miss.

Counters: a tier counts in ``metrics``, a recorder scope with its ``tier`` label
fixed (:mod:`kvoffload.core.observe.recorder`): the tier itself counts its spills' outcome,
the tier planner its lookups, hits and promotions' outcome. A
:class:`DirectoryTier` shares its directory's scope (one tier, one label set).

Owned by the scheduler half; no bytes, no I/O in this module.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvoffload.core.directory import HostDirectory
from kvoffload.core.keys import ChunkKey
from kvoffload.core.observe.events import CacheEvent
from kvoffload.core.observe.recorder import CounterScope


@dataclass(frozen=True)
class SpillBooking:
    """What a spill job must write: ``keys``, at ``slots`` in a slotted tier;
    ``later``: keys the tier has no room for yet (to offer again next plan)."""

    keys: tuple[ChunkKey, ...]
    slots: tuple[int, ...] = ()
    later: tuple[ChunkKey, ...] = ()


def declare_tier_counters(metrics: CounterScope) -> None:
    """The series every lower tier exports from the start (at 0): lookups, hit
    tokens, chunks spilled, promoted and loaded straight into the engine (tier loads)
    and those that failed, chunks missing,
    refused spills (a directory tier's directory counts these; the Redis index never
    refuses one)."""
    metrics.declare("lookups_total", "hit_tokens_total", "missing_chunks_total", "no_room_total")
    for direction in ("spill", "promote", "load"):
        metrics.declare("transferred_chunks_total", "failed_chunks_total", direction=direction)
        metrics.declare("tier_io_timeouts_total", direction=direction)


class LowerTier(Protocol):
    name: str
    metrics: CounterScope  # its counters, labelled with ``name``

    def present_run(self, keys: Sequence[ChunkKey]) -> int | None:
        """How many leading ``keys`` the tier holds; None while it cannot tell yet
        (ask again later). No side effect on the tier's contents."""

    def holds(self, key: ChunkKey) -> bool:
        """Whether the tier is known to hold ``key`` now (no I/O, no side effect; a
        non-authoritative tier answers from what it saw)."""

    def book_promotion(self, keys: Sequence[ChunkKey]) -> tuple[int, ...] | None:
        """``keys`` (all present at the lookup) are about to be read: keep them until
        released. Their slots in a slotted tier, else ``()``; None, keeping nothing,
        when the tier cannot keep them now (a tier shared by several engines may have
        lost one to another engine's eviction, or not answer): a miss."""

    def release_promotion(self, keys: Sequence[ChunkKey], bad: Sequence[ChunkKey]) -> None:
        """The read of ``keys`` ended; ``bad`` ones were missing or corrupt: forget them."""

    def book_spill(self, keys: Sequence[ChunkKey]) -> SpillBooking | None:
        """Reserve room for the ``keys`` not held yet (as many as fit, the others
        ``later``); None when there is no room at all."""

    def complete_spill(self, written: Sequence[ChunkKey], failed: Sequence[ChunkKey]) -> None:
        """The spill job ended: ``written`` are held now, ``failed`` are not."""

    def take_events(self) -> list[CacheEvent]: ...

    def held_count(self) -> int:
        """Chunks the tier is known to hold (for usage reporting)."""

    def reset(self) -> None:
        """A connector reset: forget every chunk (they are never asked for again: the
        keys changed epoch). Bookings in flight still complete."""


class DirectoryTier:
    """A bounded, authoritative, slotted lower tier (the disk), booked in its own
    directory (a :class:`~kvoffload.core.directory.HostDirectory`): a private one, or
    the client of a directory that a node process keeps for every engine of the node
    (which answers a call it cannot make as a miss or ``no_room``)."""

    def __init__(self, directory: HostDirectory) -> None:
        self.directory = directory
        self.name = directory.tier
        self.metrics = directory.metrics
        declare_tier_counters(self.metrics)

    def present_run(self, keys: Sequence[ChunkKey]) -> int:
        return self.directory.readable_prefix(keys)

    def holds(self, key: ChunkKey) -> bool:
        return self.directory.readable_prefix((key,)) == 1

    def book_promotion(self, keys: Sequence[ChunkKey]) -> tuple[int, ...] | None:
        return self.directory.try_prepare_load(keys)

    def release_promotion(self, keys: Sequence[ChunkKey], bad: Sequence[ChunkKey]) -> None:
        self.directory.complete_load(keys)
        self.directory.discard(bad)  # the worker that found a bad copy already cleared it

    def book_spill(self, keys: Sequence[ChunkKey]) -> SpillBooking | None:
        directory = self.directory
        prepared = directory.prepare_store(keys)
        if not prepared.no_room:
            return SpillBooking(prepared.keys, prepared.slots)
        # Counted by the directory (no_room_total); book the leading keys that fit.
        room = directory.free_slots + directory.evictable_count
        if room <= 0:
            return None
        prepared = directory.prepare_store(keys[:room])
        if prepared.no_room:
            return None
        return SpillBooking(prepared.keys, prepared.slots, tuple(keys[room:]))

    def complete_spill(self, written: Sequence[ChunkKey], failed: Sequence[ChunkKey]) -> None:
        if written:
            self.directory.complete_store(written, success=True)
        if failed:
            # The slot is free again; what a worker wrote there is overwritten by the
            # next chunk, and start-up recovery needs every rank's copy to adopt it.
            self.directory.complete_store(failed, success=False)
        self.metrics.count("transferred_chunks_total", len(written), direction="spill")
        self.metrics.count("failed_chunks_total", len(failed), direction="spill")

    def take_events(self) -> list[CacheEvent]:
        return self.directory.take_events()

    def held_count(self) -> int:
        return len(self.directory)

    def reset(self) -> None:
        self.directory.reset()
