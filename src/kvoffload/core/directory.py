"""The chunk directory of one tier: which chunk lives in which slot, pins, eviction.

Bookkeeping only; it never moves bytes. Ownership: the directory owns the slot
table (key -> slot, per-slot state and pin count), the free list, the admission
counters and the pending events; the eviction policy (owned by the directory)
owns only the order of readable chunks. Callers own nothing inside it and receive
immutable results.

Two-phase operations keep slots safe while bytes move:

- ``prepare_load(keys)`` pins READY chunks (pinned chunks are never evicted) and
  returns their slots; ``complete_load(keys)`` unpins.
- ``prepare_store(keys)`` allocates STORING slots (never evicted, never readable)
  and ``complete_store(keys, success)`` makes them READY or frees them.

Failure contract: a caller breaking a precondition (loading a chunk that is not a
hit, completing what was not prepared) gets :class:`ContractViolation` and the
directory is unchanged. Transfer failures are not exceptions: they arrive as
``complete_store(..., success=False)``.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

from kvoffload.core.admission import AdmissionFilter
from kvoffload.core.chunk_state import ChunkState, check_transition
from kvoffload.core.directory_types import (
    DirectoryStats,
    LookupResult,
    LookupStatus,
    PreparedStore,
)
from kvoffload.core.errors import ConfigError, ContractViolation
from kvoffload.core.events import CacheEvent, EventKind
from kvoffload.core.keys import ChunkKey
from kvoffload.core.policies import EvictionPolicy, make_policy
from kvoffload.core.slot_table import _LOADING, _READY, _STORING, SlotTable

__all__ = ["Directory", "LookupResult", "LookupStatus", "PreparedStore"]


class Directory(SlotTable):
    """Slot bookkeeping for one tier with ``num_slots`` slots.

    ``store_threshold`` N >= 2 admits a chunk only after ``record_lookups`` saw it
    N times (see :class:`~kvoffload.core.admission.AdmissionFilter`).
    """

    def __init__(
        self,
        num_slots: int,
        *,
        tier: str = "host",
        policy: str | EvictionPolicy = "lru",
        store_threshold: int = 1,
        max_admission_counters: int = 65536,
    ) -> None:
        if not isinstance(num_slots, int) or num_slots <= 0:
            raise ConfigError("num_slots", f"must be a positive integer, got {num_slots!r}")
        self.tier = tier
        self.admission = AdmissionFilter(store_threshold, max_admission_counters)
        self.policy = make_policy(policy, num_slots) if isinstance(policy, str) else policy
        self.stats = DirectoryStats()
        self._init_table(num_slots)
        self._events: list[CacheEvent] = []

    # ---------------------------------------------------------------- recency and admission

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        """Mark readable ``keys`` as used, walking backwards so ``keys[0]`` ends up
        most recent (a prefix's head outlives its tail). Absent keys are ignored."""
        index, state, policy = self._index, self._state, self.policy
        for key in reversed(keys):
            slot = index.get(key)
            if slot is not None and state[slot] != _STORING:
                policy.touch(key)

    def record_lookups(self, keys: Iterable[ChunkKey]) -> None:
        """Count one request's interest in ``keys`` toward admission (no-op when
        ``store_threshold`` is 1). Present keys are not counted."""
        if self.admission.active:
            index = self._index
            self.admission.record(k for k in keys if k not in index)

    # ------------------------------------------------------------------ loads

    def prepare_load(self, keys: Sequence[ChunkKey]) -> tuple[int, ...]:
        """Pin every key (each must be a HIT) and return their slots, in order."""
        index, state = self._index, self._state
        slots = []
        for key in keys:
            slot = index.get(key)
            if slot is None or state[slot] == _STORING:
                raise ContractViolation(f"{self.tier}: prepare_load of a chunk that is not a hit")
            slots.append(slot)
        for slot in slots:
            self._pin(slot)
        self.stats.loads_prepared += 1
        return tuple(slots)

    def complete_load(self, keys: Sequence[ChunkKey]) -> None:
        """Drop one pin per key (taken by ``prepare_load``). A chunk discarded while
        pinned is freed when its last pin goes."""
        located = [self._locate_pinned(key) for key in keys]
        needed: dict[int, int] = {}
        for _, slot in located:
            needed[slot] = needed.get(slot, 0) + 1
        for slot, count in needed.items():
            if self._pins[slot] < count:
                raise ContractViolation(f"{self.tier}: complete_load without a matching pin")
        for key, slot in located:
            self._unpin(key, slot)

    def _locate(self, key: ChunkKey, state: int) -> tuple[int, bool] | None:
        """(slot, live) of ``key`` if its live or discarded copy is in ``state``."""
        slot = self._index.get(key)
        if slot is not None:
            return (slot, True) if self._state[slot] == state else None
        slot = self._discarded.get(key)
        if slot is not None and self._state[slot] == state:
            return slot, False
        return None

    def _locate_pinned(self, key: ChunkKey) -> tuple[ChunkKey, int]:
        found = self._locate(key, _LOADING)
        if found is None:
            raise ContractViolation(f"{self.tier}: complete_load of a chunk that is not pinned")
        return key, found[0]

    def _pin(self, slot: int) -> None:
        if self._state[slot] == _READY:
            self._set_state(slot, ChunkState.LOADING)
            self._evictable -= 1
        else:
            check_transition(self._state[slot], ChunkState.LOADING)
        self._pins[slot] += 1

    def _unpin(self, key: ChunkKey, slot: int) -> None:
        self._pins[slot] -= 1
        if self._pins[slot] > 0:
            return
        if self._index.get(key) == slot:
            self._set_state(slot, ChunkState.READY)
            self._evictable += 1
        else:
            self._free_slot(slot)
            del self._discarded[key]

    # ------------------------------------------------------------------ stores

    def prepare_store(self, keys: Sequence[ChunkKey], *, admit_all: bool = False) -> PreparedStore:
        """Allocate STORING slots for the keys that are new and admitted.

        Skipped: keys present in any state, keys whose discarded copy is still in
        flight, duplicates. Refused: keys below the admission threshold (unless
        ``admit_all``: a chunk coming back from a lower tier was admitted once).

        Evicts atomically: if the free slots plus the evictable chunks (READY,
        unpinned, not among ``keys``) cannot hold every new key, nothing changes
        and the result says ``no_room``.
        """
        index = self._index
        seen: set[ChunkKey] = set()
        new: list[ChunkKey] = []
        refused: list[ChunkKey] = []
        present: list[ChunkKey] = []
        for key in keys:
            if key in seen:
                continue
            seen.add(key)
            if key in index:
                present.append(key)
            elif key in self._discarded:
                continue  # its old copy is still in flight; store it again later
            elif not admit_all and not self.admission.admits(key):
                refused.append(key)
            else:
                new.append(key)
        self.stats.admission_refusals += len(refused)
        if not new:
            return PreparedStore(refused=tuple(refused))
        evicted = self._make_room(len(new) - len(self._free), present)
        if evicted is None:
            self.stats.no_room += 1
            return PreparedStore(refused=tuple(refused), no_room=True)
        slots = []
        for key in new:
            slot = self._free.pop()
            self._set_state(slot, ChunkState.STORING)
            index[key] = slot
            self._slot_key[slot] = key
            self.admission.forget(key)
            slots.append(slot)
        self.stats.stores_prepared += len(new)
        return PreparedStore(tuple(new), tuple(slots), evicted, tuple(refused))

    def _make_room(self, needed: int, protected: list[ChunkKey]) -> tuple[ChunkKey, ...] | None:
        if needed <= 0:
            return ()
        index, state = self._index, self._state
        shielded = {k for k in protected if state[index[k]] == _READY}
        if self._evictable - len(shielded) < needed:
            return None
        victims = self.policy.evict(
            needed, lambda k: k not in shielded and state[index[k]] == _READY
        )
        for key in victims:
            self._free_slot(index.pop(key))
        self._evictable -= len(victims)
        self.stats.evictions += len(victims)
        self._events.append(CacheEvent(EventKind.REMOVED, tuple(victims), self.tier))
        return tuple(victims)

    def complete_store(self, keys: Sequence[ChunkKey], success: bool) -> None:
        """Finish stores prepared earlier: READY on success, freed on failure. A
        store of a chunk discarded meanwhile frees its slot either way."""
        located: list[tuple[ChunkKey, int, bool]] = []
        for key in keys:
            found = self._locate(key, _STORING)
            if found is None:
                raise ContractViolation(f"{self.tier}: complete_store of a chunk not being stored")
            located.append((key, *found))
        if len({slot for _, slot, _ in located}) != len(located):
            raise ContractViolation(f"{self.tier}: complete_store names a chunk twice")
        stored: list[ChunkKey] = []
        for key, slot, live in reversed(located):
            if live and success:
                self._set_state(slot, ChunkState.READY)
                self.policy.insert(key)
                self._evictable += 1
                stored.append(key)
            elif live:
                del self._index[key]
                self._free_slot(slot)
            else:
                self._free_slot(slot)
                del self._discarded[key]
        if success:
            self.stats.stores_completed += len(stored)
        else:
            self.stats.stores_failed += len(located)
        if stored:
            stored.reverse()
            self._events.append(CacheEvent(EventKind.STORED, tuple(stored), self.tier))

    # ------------------------------------------------------------------ removal

    def discard(self, keys: Iterable[ChunkKey]) -> list[ChunkKey]:
        """Make ``keys`` miss from now on (e.g. a lower tier found a bad copy).

        READY chunks are freed at once; pinned or storing chunks leave the index now
        and free their slot when their job completes. Returns the keys that were
        readable (a REMOVED event names them)."""
        removed: list[ChunkKey] = []
        for key in keys:
            slot = self._index.pop(key, None)
            if slot is None:
                continue
            self.stats.discarded += 1
            current = self._state[slot]
            if current != _STORING:
                removed.append(key)
                self.policy.remove(key)
            if current == _READY:
                self._evictable -= 1
                self._free_slot(slot)
            else:
                self._discarded[key] = slot
        if removed:
            self._events.append(CacheEvent(EventKind.REMOVED, tuple(removed), self.tier))
        return removed

    def reset(self) -> list[ChunkKey]:
        """Discard everything, forget policy history and admission counters."""
        removed = self.discard(list(self._index))
        self.policy.clear()
        self.admission.clear()
        return removed

    def restore(self, entries: Sequence[tuple[ChunkKey, int]]) -> None:
        """Adopt chunks found in storage at start-up: each key READY in its given slot,
        least recently used first. Only on an empty directory; keys and slots must be
        distinct and in range (else :class:`ContractViolation`). Emits STORED."""
        if self._index or self._discarded:
            raise ContractViolation(f"{self.tier}: restore into a directory in use")
        slots = [slot for _, slot in entries]
        keys = [key for key, _ in entries]
        if len(set(slots)) != len(slots) or len(set(keys)) != len(keys):
            raise ContractViolation(f"{self.tier}: restore names a slot or a key twice")
        if any(not 0 <= slot < self.num_slots for slot in slots):
            raise ContractViolation(f"{self.tier}: restore slot out of range")
        for key, slot in entries:
            self._set_state(slot, ChunkState.STORING)
            self._set_state(slot, ChunkState.READY)
            self._index[key] = slot
            self._slot_key[slot] = key
            self.policy.insert(key)
        used = set(slots)
        self._free = array("i", (s for s in range(self.num_slots - 1, -1, -1) if s not in used))
        self._evictable += len(entries)
        self.stats.stores_completed += len(entries)
        if entries:
            self._events.append(CacheEvent(EventKind.STORED, tuple(keys), self.tier))

    def take_events(self) -> list[CacheEvent]:
        """Events since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    # ------------------------------------------------------------------ internals

    def _set_state(self, slot: int, target: ChunkState) -> None:
        check_transition(self._state[slot], target)
        self._state[slot] = target

    def _free_slot(self, slot: int) -> None:
        self._set_state(slot, ChunkState.FREE)
        self._pins[slot] = 0
        self._slot_key[slot] = None
        self._free.append(slot)

    def check_integrity(self) -> None:
        """Verify every internal invariant; raise ContractViolation naming the first
        broken one. O(num_slots): for tests and debug runs."""
        from kvoffload.core.directory_integrity import verify

        verify(self)
