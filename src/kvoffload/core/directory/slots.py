"""The slot table of one tier's directory: its state, queries and slot primitives.

Ownership: a :class:`SlotTable` is created and held by exactly one
:class:`~kvoffload.core.directory.Directory`, which alone calls its mutating
primitives (``set_state``, ``allocate``, ``finish_store``, ``unlink``,
``drop_ready``, ``free_slot``, ``pin``, ``unpin``, ``adopt``); nobody else holds a
reference. It owns the key -> slot index, the per-slot state, key and pin count,
the free list, the evictable count, the discarded chunks still holding a slot, and
each allocated slot's KV cache group (``group``, set when the slot is allocated for a
store: the one owner of a host chunk's group, which tier jobs read; 0 for every chunk
of a one-group layout).
It knows nothing of eviction order, admission, counters or events (the
directory's), and never raises :class:`ContractViolation`: the directory checks
preconditions first (with ``hit_slots``, ``locate_all``, ``adoption_problem``).
Every state change goes through :func:`~kvoffload.core.chunk_state.check_transition`.

The fields are plain attributes so the directory's hot paths can read them
without calls; the queries below have no side effects.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from kvoffload.core.chunk_state import ChunkState, check_transition
from kvoffload.core.directory.results import LookupResult, LookupStatus
from kvoffload.core.keys import ChunkKey

_FREE = int(ChunkState.FREE)
_STORING = int(ChunkState.STORING)
_READY = int(ChunkState.READY)
_PINNED = int(ChunkState.PINNED)


class SlotTable:
    """Per-slot bookkeeping of ``num_slots`` slots (see the module docstring)."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.index: dict[ChunkKey, int] = {}
        self.slot_key: list[ChunkKey | None] = [None] * num_slots
        self.state = bytearray(num_slots)
        self.pins = array("i", bytes(4 * num_slots))
        self.group = array("H", bytes(2 * num_slots))  # the KV cache group of its chunk
        self.free = array("i", range(num_slots - 1, -1, -1))
        self.evictable = 0
        # Chunks discarded while STORING or PINNED: out of the index (they miss),
        # slot still allocated until their job completes. Such a key is not stored
        # again until then, so a key is live or discarded, never both, and every
        # completion names exactly one slot.
        self.discarded: dict[ChunkKey, int] = {}

    # ------------------------------------------------------------------ queries

    def lookup(self, keys: Sequence[ChunkKey]) -> LookupResult:
        """Per-key status and the length of the leading readable run."""
        state = self.state
        miss, hit, pending = LookupStatus.MISS, LookupStatus.HIT, LookupStatus.HIT_PENDING
        statuses = [
            miss if slot is None else pending if state[slot] == _STORING else hit
            for slot in map(self.index.get, keys)
        ]
        prefix = len(statuses)
        for status in (miss, pending):
            if status in statuses:
                prefix = min(prefix, statuses.index(status))
        return LookupResult(tuple(statuses), prefix)

    def readable_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """Number of leading keys that are readable now (fast path of ``lookup``)."""
        state = self.state
        for i, slot in enumerate(map(self.index.get, keys)):
            if slot is None or state[slot] == _STORING:
                return i
        return len(keys)

    def state_of(self, key: ChunkKey) -> ChunkState:
        """State of ``key``'s slot; FREE when the key is not present."""
        slot = self.index.get(key)
        return ChunkState.FREE if slot is None else ChunkState(self.state[slot])

    def pins_of(self, key: ChunkKey) -> int:
        slot = self.index.get(key)
        return 0 if slot is None else self.pins[slot]

    def storing_count(self) -> int:
        """Slots in STORING state (live or discarded)."""
        return self.state.count(_STORING)

    def locate(self, key: ChunkKey, state: int) -> tuple[int, bool] | None:
        """(slot, live) of ``key`` if its live or discarded copy is in ``state``."""
        slot = self.index.get(key)
        if slot is not None:
            return (slot, True) if self.state[slot] == state else None
        slot = self.discarded.get(key)
        if slot is not None and self.state[slot] == state:
            return slot, False
        return None

    def hit_slots(self, keys: Sequence[ChunkKey]) -> list[int] | None:
        """The slots of ``keys``, in order, if every one is readable now; else None."""
        index, state = self.index, self.state
        slots = []
        for slot in map(index.get, keys):
            if slot is None or state[slot] == _STORING:
                return None
            slots.append(slot)
        return slots

    def locate_all(
        self, keys: Sequence[ChunkKey], state: int
    ) -> list[tuple[ChunkKey, int, bool]] | None:
        """(key, slot, live) per key, each key's live or discarded copy being in
        ``state``; None if one is not."""
        located = []
        for key in keys:
            found = self.locate(key, state)
            if found is None:
                return None
            located.append((key, *found))
        return located

    # ------------------------------------------------------------------ primitives

    def set_state(self, slot: int, target: ChunkState) -> None:
        check_transition(self.state[slot], target)
        self.state[slot] = target

    def allocate(self, key: ChunkKey, group: int = 0) -> int:
        """Take a free slot for ``key`` (absent, not discarded), a chunk of KV cache
        group ``group``, in STORING state."""
        slot = self.free.pop()
        self.set_state(slot, ChunkState.STORING)
        self.index[key] = slot
        self.slot_key[slot] = key
        self.group[slot] = group
        return slot

    def free_slot(self, slot: int) -> None:
        """Return ``slot`` to the free list; the caller already unlinked its key."""
        self.set_state(slot, ChunkState.FREE)
        self.pins[slot] = 0
        self.slot_key[slot] = None
        self.free.append(slot)

    def finish_store(self, key: ChunkKey, slot: int, live: bool, success: bool) -> bool:
        """End the store of ``key`` in STORING ``slot``: READY (and evictable) if it is
        live and ``success``, else freed. True when it became READY."""
        if live and success:
            self.set_state(slot, ChunkState.READY)
            self.evictable += 1
            return True
        del (self.index if live else self.discarded)[key]
        self.free_slot(slot)
        return False

    def unlink(self, key: ChunkKey) -> int | None:
        """Take ``key`` out of the index; return its state code (None: absent). A READY
        slot is freed now; a STORING or pinned one becomes discarded."""
        slot = self.index.pop(key, None)
        if slot is None:
            return None
        current = self.state[slot]
        if current == _READY:
            self.evictable -= 1
            self.free_slot(slot)
        else:
            self.discarded[key] = slot
        return current

    def drop_ready(self, keys: Sequence[ChunkKey]) -> None:
        """Free the slots of READY ``keys`` (evicted) and unlink them."""
        for key in keys:
            self.free_slot(self.index.pop(key))
        self.evictable -= len(keys)

    def pin(self, slot: int) -> None:
        """One more pin on a READY or pinned slot (the first leaves the evictable set)."""
        if self.state[slot] == _READY:
            self.set_state(slot, ChunkState.PINNED)
            self.evictable -= 1
        else:
            check_transition(self.state[slot], ChunkState.PINNED)
        self.pins[slot] += 1

    def unpin(self, key: ChunkKey, slot: int) -> None:
        """Drop one pin; the last makes a live chunk READY, frees a discarded one."""
        self.pins[slot] -= 1
        if self.pins[slot] > 0:
            return
        if self.index.get(key) == slot:
            self.set_state(slot, ChunkState.READY)
            self.evictable += 1
        else:
            self.free_slot(slot)
            del self.discarded[key]

    def adoption_problem(self, entries: Sequence[tuple[ChunkKey, int]]) -> str | None:
        """Why ``adopt(entries)`` is not allowed (table in use, a key or slot named
        twice, a slot out of range), or None."""
        if self.index or self.discarded:
            return "into a directory in use"
        slots = [slot for _, slot in entries]
        if len(set(slots)) != len(slots) or len({key for key, _ in entries}) != len(slots):
            return "names a slot or a key twice"
        if any(not 0 <= slot < self.num_slots for slot in slots):
            return "slot out of range"
        return None

    def adopt(self, entries: Sequence[tuple[ChunkKey, int]]) -> None:
        """Make each (key, slot) READY in that slot (group 0: adopted chunks are the
        disk tier's, whose groups live in its headers) and rebuild the free list. Only
        when ``adoption_problem(entries)`` is None (the caller checks)."""
        for key, slot in entries:
            self.set_state(slot, ChunkState.STORING)
            self.set_state(slot, ChunkState.READY)
            self.index[key] = slot
            self.slot_key[slot] = key
            self.group[slot] = 0
        used = {slot for _, slot in entries}
        self.free = array("i", (s for s in range(self.num_slots - 1, -1, -1) if s not in used))
        self.evictable += len(entries)
