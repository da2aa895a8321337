"""The chunk directory of one tier: which chunk lives in which slot, pins, eviction.

The engine's own implementation of
:class:`~kvoffload.core.directory.host_directory.HostDirectory` (checked statically below).

Bookkeeping only; it never moves bytes. Ownership: the directory holds, and alone
mutates, its :class:`~kvoffload.core.directory.slots.SlotTable` (key -> slot,
per-slot state and pins, free list), its admission filter and the pending events;
the eviction policy (held by the directory) owns only the order of readable chunks.
Callers own nothing inside it and receive immutable results; the slot table's queries
are offered here by delegation. Its counters go to ``metrics`` (see :class:`Directory`).

Two-phase operations keep slots safe while bytes move:

- ``prepare_load(keys)`` pins READY chunks (pinned chunks are never evicted) and
  returns their slots; ``complete_load(keys)`` unpins.
- ``prepare_store(keys)`` allocates STORING slots (never evicted, never readable)
  and ``complete_store(keys, success)`` makes them READY or frees them.

A chunk's KV cache group is kept with its slot (``prepare_store(groups=)``, ``groups_of``).

``on_evict`` (set by the owner, e.g. the tier planner): called with the chunks each
eviction took, after they left the directory (it must not call back into it).

Failure contract: a caller breaking a precondition (loading a chunk that is not a
hit, completing what was not prepared) gets :class:`ContractViolation` and the
directory is unchanged. Transfer failures are not exceptions: they arrive as
``complete_store(..., success=False)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kvoffload.core.chunk_state import ChunkState
from kvoffload.core.config.own_options import default
from kvoffload.core.directory.admission import (
    MAX_ADMISSION_COUNTERS,
    AdmissionFilter,
    sort_store_keys,
)
from kvoffload.core.directory.host_directory import EvictionHook
from kvoffload.core.directory.integrity import verify
from kvoffload.core.directory.results import LookupResult, PreparedStore
from kvoffload.core.directory.room import evict_for
from kvoffload.core.directory.slots import _PINNED, _STORING, SlotTable
from kvoffload.core.errors import ConfigError, ContractViolation
from kvoffload.core.keys import ChunkKey
from kvoffload.core.observe.events import CacheEvent, EventKind
from kvoffload.core.observe.recorder import CounterScope
from kvoffload.core.policies import EvictionPolicy, make_policy

__all__ = ["DIRECTORY_COUNTERS", "Directory"]

DIRECTORY_COUNTERS = ("evictions_total", "admission_refusals_total", "no_room_total")
"""What a directory counts, under its ``tier`` label (exported at 0 from the start)."""
_EVICTION: str = default("eviction")  # a directory's policy unless given


class Directory:
    """Slot bookkeeping for one tier with ``num_slots`` slots.

    ``store_threshold`` N >= 2 admits a chunk only after ``record_lookups`` saw it
    N times (see :class:`~kvoffload.core.directory.admission.AdmissionFilter`).

    ``metrics``: where it counts :data:`DIRECTORY_COUNTERS` (chunks evicted, chunks
    refused admission, ``prepare_store`` calls without room), labelled with its
    tier; a recorder of its own until the owning scheduler half rebinds it onto
    its recorder.
    """

    def __init__(
        self,
        num_slots: int,
        *,
        tier: str = "host",
        policy: str | EvictionPolicy = _EVICTION,
        store_threshold: int = default("store_threshold"),
        max_admission_counters: int = MAX_ADMISSION_COUNTERS,
    ) -> None:
        if not isinstance(num_slots, int) or num_slots <= 0:
            raise ConfigError("num_slots", f"must be a positive integer, got {num_slots!r}")
        self.tier = tier
        self.admission = AdmissionFilter(store_threshold, max_admission_counters)
        self.policy = make_policy(policy, num_slots) if isinstance(policy, str) else policy
        self.metrics = CounterScope.private(tier=tier)
        self.metrics.declare(*DIRECTORY_COUNTERS)
        self._slots = SlotTable(num_slots)
        self._events: list[CacheEvent] = []
        self.on_evict: EvictionHook | None = None

    # ------------------------------------------------------------ queries (no side effects)

    @property
    def num_slots(self) -> int:
        return self._slots.num_slots

    def lookup(self, keys: Sequence[ChunkKey]) -> LookupResult:
        """Per-key status and the length of the leading readable run."""
        return self._slots.lookup(keys)

    def readable_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """Number of leading keys that are readable now (fast path of ``lookup``)."""
        return self._slots.readable_prefix(keys)

    def present_keys(self) -> list[ChunkKey]:
        """Every key present (STORING, READY or PINNED)."""
        return list(self._slots.index)

    def groups_of(self, slots: Sequence[int]) -> tuple[int, ...]:
        """The KV cache group of the chunk in each of ``slots`` (allocated slots)."""
        return tuple(self._slots.group[slot] for slot in slots)

    def slots_of(self, keys: Sequence[ChunkKey]) -> tuple[int, ...]:
        """The slots of present ``keys`` (any state but FREE), in order; a key that is
        not present is a :class:`ContractViolation`."""
        index = self._slots.index
        if any(key not in index for key in keys):
            raise ContractViolation(f"{self.tier}: slots_of a chunk that is not present")
        return tuple(index[key] for key in keys)

    def slot_of(self, key: ChunkKey) -> int | None:
        """The slot holding ``key`` (any state but FREE), or None."""
        return self._slots.index.get(key)

    def state_of(self, key: ChunkKey) -> ChunkState:
        """State of ``key``'s slot; FREE when the key is not present."""
        return self._slots.state_of(key)

    def pins_of(self, key: ChunkKey) -> int:
        return self._slots.pins_of(key)

    @property
    def used_slots(self) -> int:
        return self._slots.num_slots - self.free_slots

    @property
    def free_slots(self) -> int:
        return len(self._slots.free)

    @property
    def evictable_count(self) -> int:
        return self._slots.evictable

    @property
    def storing_count(self) -> int:
        """Slots in STORING state (live or discarded)."""
        return self._slots.storing_count()

    @property
    def pinned_count(self) -> int:
        """Total pins held (on readable and discarded chunks)."""
        return sum(self._slots.pins)

    def __len__(self) -> int:
        """Chunks present (STORING, READY or PINNED), discarded ones excluded."""
        return len(self._slots.index)

    def __contains__(self, key: object) -> bool:
        return key in self._slots.index

    # ---------------------------------------------------------------- recency and admission

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        """Mark readable ``keys`` as used, walking backwards so ``keys[0]`` ends up
        most recent (a prefix's head outlives its tail). Absent keys are ignored."""
        index, state, policy = self._slots.index, self._slots.state, self.policy
        for key in reversed(keys):
            slot = index.get(key)
            if slot is not None and state[slot] != _STORING:
                policy.touch(key)

    def record_lookups(self, keys: Iterable[ChunkKey]) -> None:
        """Count one request's interest in ``keys`` toward admission (no-op when
        ``store_threshold`` is 1). Present keys are not counted."""
        if self.admission.active:
            index = self._slots.index
            self.admission.record(k for k in keys if k not in index)

    # ------------------------------------------------------------------ loads

    def prepare_load(self, keys: Sequence[ChunkKey]) -> tuple[int, ...]:
        """Pin every key (each must be a HIT) and return their slots, in order."""
        table = self._slots
        slots = table.hit_slots(keys)
        if slots is None:
            raise ContractViolation(f"{self.tier}: prepare_load of a chunk that is not a hit")
        for slot in slots:
            table.pin(slot)
        return tuple(slots)

    def try_prepare_load(self, keys: Sequence[ChunkKey]) -> tuple[int, ...] | None:
        """As :meth:`prepare_load`, or None (nothing pinned) when a key is not a hit.
        The scheduler half pins through this, since a shared directory
        (:class:`~kvoffload.share.client.ShareDirectory`) may lose a hit to another
        engine between lookup and load, or not answer: a miss at load time."""
        if self._slots.hit_slots(keys) is None:
            return None
        return self.prepare_load(keys)

    def complete_load(self, keys: Sequence[ChunkKey]) -> None:
        """Drop one pin per key (taken by ``prepare_load``). A chunk discarded while
        pinned is freed when its last pin goes."""
        table = self._slots
        located = table.locate_all(keys, _PINNED)
        if located is None:
            raise ContractViolation(f"{self.tier}: complete_load of a chunk that is not pinned")
        needed: dict[int, int] = {}
        for _, slot, _ in located:
            needed[slot] = needed.get(slot, 0) + 1
        if any(table.pins[slot] < count for slot, count in needed.items()):
            raise ContractViolation(f"{self.tier}: complete_load without a matching pin")
        for key, slot, _ in located:
            table.unpin(key, slot)

    # ------------------------------------------------------------------ stores

    def prepare_store(
        self,
        keys: Sequence[ChunkKey],
        *,
        admit_all: bool = False,
        groups: Sequence[int] | None = None,
    ) -> PreparedStore:
        """Allocate STORING slots for the keys that are new and admitted; ``groups``
        (one per key; None: all 0) are their KV cache groups, kept with the slots.

        Skipped: keys present in any state, keys whose discarded copy is still in
        flight, duplicates. Refused: keys below the admission threshold (unless
        ``admit_all``: a chunk coming back from a lower tier was admitted once).

        Evicts atomically: if the free slots plus the evictable chunks (READY,
        unpinned, not among ``keys``) cannot hold every new key, nothing changes
        and the result says ``no_room``.
        """
        table = self._slots
        if groups is not None and len(groups) != len(keys):
            raise ContractViolation(f"{self.tier}: prepare_store needs one group per key")
        group_of = None if groups is None else dict(zip(keys, groups, strict=True))
        admission = None if admit_all else self.admission
        new, refused, present = sort_store_keys(keys, table.index, table.discarded, admission)
        if refused:
            self.metrics.count("admission_refusals_total", len(refused))
        if not new:
            return PreparedStore(refused=tuple(refused))
        evicted = self._make_room(len(new) - len(table.free), present)
        if evicted is None:
            self.metrics.count("no_room_total")
            return PreparedStore(refused=tuple(refused), no_room=True)
        slots = []
        for key in new:
            slots.append(table.allocate(key, 0 if group_of is None else group_of[key]))
            self.admission.forget(key)
        return PreparedStore(tuple(new), tuple(slots), evicted, tuple(refused))

    def _make_room(self, needed: int, protected: list[ChunkKey]) -> tuple[ChunkKey, ...] | None:
        victims = evict_for(self._slots, self.policy, needed, protected)
        if victims:
            self.metrics.count("evictions_total", len(victims))
            self._events.append(CacheEvent(EventKind.REMOVED, victims, self.tier))
            if self.on_evict is not None:
                self.on_evict(victims)
        return victims

    def complete_store(self, keys: Sequence[ChunkKey], success: bool) -> None:
        """Finish stores prepared earlier: READY on success, freed on failure. A
        store of a chunk discarded meanwhile frees its slot either way."""
        table = self._slots
        located = table.locate_all(keys, _STORING)
        if located is None:
            raise ContractViolation(f"{self.tier}: complete_store of a chunk not being stored")
        if len({slot for _, slot, _ in located}) != len(located):
            raise ContractViolation(f"{self.tier}: complete_store names a chunk twice")
        stored: list[ChunkKey] = []
        for key, slot, live in reversed(located):
            if table.finish_store(key, slot, live, success):
                self.policy.insert(key)
                stored.append(key)
        if stored:
            stored.reverse()
            self._events.append(CacheEvent(EventKind.STORED, tuple(stored), self.tier))

    # ------------------------------------------------------------------ removal

    def discard(self, keys: Iterable[ChunkKey]) -> list[ChunkKey]:
        """Make ``keys`` miss from now on (e.g. a lower tier found a bad copy).

        READY chunks are freed at once; pinned or storing chunks leave the index now
        and free their slot when their job completes. Returns the keys that were
        readable (a REMOVED event names them)."""
        table = self._slots
        removed: list[ChunkKey] = []
        for key in keys:
            current = table.unlink(key)
            if current is None:
                continue
            if current != _STORING:
                removed.append(key)
                self.policy.remove(key)
        if removed:
            self._events.append(CacheEvent(EventKind.REMOVED, tuple(removed), self.tier))
        return removed

    def reset(self) -> list[ChunkKey]:
        """Discard everything, forget policy history and admission counters."""
        removed = self.discard(list(self._slots.index))
        self.policy.clear()
        self.admission.clear()
        return removed

    def restore(self, entries: Sequence[tuple[ChunkKey, int]]) -> None:
        """Adopt chunks found in storage at start-up: each key READY in its given slot,
        least recently used first. Only on an empty directory; keys and slots must be
        distinct and in range (else :class:`ContractViolation`). Emits STORED."""
        problem = self._slots.adoption_problem(entries)
        if problem is not None:
            raise ContractViolation(f"{self.tier}: restore {problem}")
        self._slots.adopt(entries)
        keys = [key for key, _ in entries]
        for key in keys:
            self.policy.insert(key)
        if entries:
            self._events.append(CacheEvent(EventKind.STORED, tuple(keys), self.tier))

    def take_events(self) -> list[CacheEvent]:
        """Events since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def check_integrity(self) -> None:
        """Verify every internal invariant; raise ContractViolation naming the first
        broken one. O(num_slots): for tests and debug runs."""
        verify(self._slots, self.policy, self.admission, self.tier)


if TYPE_CHECKING:
    from kvoffload.core.directory.host_directory import HostDirectory

    _conforms: type[HostDirectory] = Directory
