"""Invariant checks of :class:`~kvoffload.core.directory.Directory` (tests, debug runs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload.core.chunk_state import ChunkState
from kvoffload.core.errors import ContractViolation

if TYPE_CHECKING:
    from kvoffload.core.directory import Directory


def _fail(d: Directory, what: str) -> None:
    raise ContractViolation(f"directory '{d.tier}' integrity: {what}")


def verify(d: Directory) -> None:
    """Raise ContractViolation naming the first broken invariant of ``d``."""
    free = list(d._free)
    if len(set(free)) != len(free):
        _fail(d, "a slot is on the free list twice")
    free_set = set(free)
    owners: dict[int, object] = {}
    for key, slot in d._index.items():
        if slot in owners:
            _fail(d, f"slot {slot} is indexed by two keys")
        owners[slot] = key
        if d._slot_key[slot] != key:
            _fail(d, f"slot {slot} does not name its key")
    for key, slot in d._discarded.items():
        if key in d._index:
            _fail(d, "a key is both live and discarded")
        if slot in owners:
            _fail(d, f"discarded slot {slot} is also indexed")
        owners[slot] = key
        if d._state[slot] not in (ChunkState.STORING, ChunkState.LOADING):
            _fail(d, f"discarded slot {slot} is {ChunkState(d._state[slot]).name}")
        if d._slot_key[slot] != key:
            _fail(d, f"discarded slot {slot} does not name its key")
    if len(owners) + len(free) != d.num_slots:
        _fail(d, f"{len(owners)} owned + {len(free)} free != {d.num_slots} slots")
    evictable = 0
    for slot in range(d.num_slots):
        state = ChunkState(d._state[slot])
        pins = d._pins[slot]
        if pins < 0:
            _fail(d, f"slot {slot} has {pins} pins")
        if (slot in free_set) != (state is ChunkState.FREE):
            _fail(d, f"slot {slot} is {state.name} but free-listed={slot in free_set}")
        if (pins > 0) != (state is ChunkState.LOADING):
            _fail(d, f"slot {slot} is {state.name} with {pins} pins")
        if state is ChunkState.FREE and d._slot_key[slot] is not None:
            _fail(d, f"free slot {slot} still names a key")
        if state is ChunkState.READY:
            evictable += 1
    if evictable != d._evictable:
        _fail(d, f"evictable count {d._evictable} != {evictable} READY slots")
    readable = {k for k, s in d._index.items() if d._state[s] != ChunkState.STORING}
    in_policy = set(d.policy)
    if len(in_policy) != len(d.policy):
        _fail(d, "the policy holds a key twice")
    if in_policy != readable:
        _fail(d, f"policy holds {len(in_policy)} keys, {len(readable)} are readable")
    if len(d.admission) > d.admission.max_counters:
        _fail(d, "admission counters exceed their bound")
