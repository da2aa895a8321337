"""The slot table of a chunk directory and its read-only queries.

:class:`SlotTable` holds the state a :class:`~kvoffload.core.directory.Directory`
mutates (key -> slot index, per-slot state, key and pin count, the free list, the
evictable count, discarded chunks still holding a slot) and answers every question
about it without side effects. All mutation lives in the directory, which inherits
this class; nothing here changes state except :meth:`_init_table`.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from kvoffload.core.chunk_state import ChunkState
from kvoffload.core.directory_types import LookupResult, LookupStatus
from kvoffload.core.keys import ChunkKey

_FREE = int(ChunkState.FREE)
_STORING = int(ChunkState.STORING)
_READY = int(ChunkState.READY)
_LOADING = int(ChunkState.LOADING)


class SlotTable:
    """Per-slot bookkeeping of ``num_slots`` slots (see the module docstring)."""

    num_slots: int

    def _init_table(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._index: dict[ChunkKey, int] = {}
        self._slot_key: list[ChunkKey | None] = [None] * num_slots
        self._state = bytearray(num_slots)
        self._pins = array("i", bytes(4 * num_slots))
        self._free = array("i", range(num_slots - 1, -1, -1))
        self._evictable = 0
        # Chunks discarded while STORING or LOADING: out of the index (they miss),
        # slot still allocated until their job completes. Such a key is not stored
        # again until then, so a key is live or discarded, never both, and every
        # completion names exactly one slot.
        self._discarded: dict[ChunkKey, int] = {}

    def lookup(self, keys: Sequence[ChunkKey]) -> LookupResult:
        """Per-key status and the length of the leading readable run. No side effects."""
        state = self._state
        miss, hit, pending = LookupStatus.MISS, LookupStatus.HIT, LookupStatus.HIT_PENDING
        statuses = [
            miss if slot is None else pending if state[slot] == _STORING else hit
            for slot in map(self._index.get, keys)
        ]
        prefix = len(statuses)
        for status in (miss, pending):
            if status in statuses:
                prefix = min(prefix, statuses.index(status))
        return LookupResult(tuple(statuses), prefix)

    def readable_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """Number of leading keys that are readable now (fast path of ``lookup``)."""
        state = self._state
        for i, slot in enumerate(map(self._index.get, keys)):
            if slot is None or state[slot] == _STORING:
                return i
        return len(keys)

    def present_keys(self) -> list[ChunkKey]:
        """Every key present (STORING, READY or LOADING)."""
        return list(self._index)

    def slot_of(self, key: ChunkKey) -> int | None:
        """The slot holding ``key`` (any state but FREE), or None."""
        return self._index.get(key)

    def state_of(self, key: ChunkKey) -> ChunkState:
        """State of ``key``'s slot; FREE when the key is not present."""
        slot = self._index.get(key)
        return ChunkState.FREE if slot is None else ChunkState(self._state[slot])

    def pins_of(self, key: ChunkKey) -> int:
        slot = self._index.get(key)
        return 0 if slot is None else self._pins[slot]

    @property
    def used_slots(self) -> int:
        return self.num_slots - len(self._free)

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def evictable_count(self) -> int:
        return self._evictable

    @property
    def storing_count(self) -> int:
        """Slots in STORING state (live or discarded)."""
        return self._state.count(_STORING)

    @property
    def pinned_count(self) -> int:
        """Total pins held (on readable and discarded chunks)."""
        return sum(self._pins)

    def __len__(self) -> int:
        """Chunks present (STORING, READY or LOADING), discarded ones excluded."""
        return len(self._index)

    def __contains__(self, key: object) -> bool:
        return key in self._index
