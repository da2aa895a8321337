"""Invariant checks of one tier's directory (tests, debug runs).

Reads, never mutates, what :class:`~kvoffload.core.directory.Directory` passes in:
its slot table, eviction policy and admission filter. It does not import the
directory module (the directory calls :func:`verify`), so there is no import cycle.
"""

from __future__ import annotations

from kvoffload.core.chunk_state import ChunkState
from kvoffload.core.directory.admission import AdmissionFilter
from kvoffload.core.directory.slots import SlotTable
from kvoffload.core.errors import ContractViolation
from kvoffload.core.policies import EvictionPolicy


def verify(t: SlotTable, policy: EvictionPolicy, admission: AdmissionFilter, tier: str) -> None:
    """Raise ContractViolation naming the first broken invariant of tier ``tier``."""

    def _fail(what: str) -> None:
        raise ContractViolation(f"directory '{tier}' integrity: {what}")

    free = list(t.free)
    if len(set(free)) != len(free):
        _fail("a slot is on the free list twice")
    free_set = set(free)
    owners: dict[int, object] = {}
    for key, slot in t.index.items():
        if slot in owners:
            _fail(f"slot {slot} is indexed by two keys")
        owners[slot] = key
        if t.slot_key[slot] != key:
            _fail(f"slot {slot} does not name its key")
    for key, slot in t.discarded.items():
        if key in t.index:
            _fail("a key is both live and discarded")
        if slot in owners:
            _fail(f"discarded slot {slot} is also indexed")
        owners[slot] = key
        if t.state[slot] not in (ChunkState.STORING, ChunkState.PINNED):
            _fail(f"discarded slot {slot} is {ChunkState(t.state[slot]).name}")
        if t.slot_key[slot] != key:
            _fail(f"discarded slot {slot} does not name its key")
    if len(owners) + len(free) != t.num_slots:
        _fail(f"{len(owners)} owned + {len(free)} free != {t.num_slots} slots")
    evictable = 0
    for slot in range(t.num_slots):
        state = ChunkState(t.state[slot])
        pins = t.pins[slot]
        if pins < 0:
            _fail(f"slot {slot} has {pins} pins")
        if (slot in free_set) != (state is ChunkState.FREE):
            _fail(f"slot {slot} is {state.name} but free-listed={slot in free_set}")
        if (pins > 0) != (state is ChunkState.PINNED):
            _fail(f"slot {slot} is {state.name} with {pins} pins")
        if state is ChunkState.FREE and t.slot_key[slot] is not None:
            _fail(f"free slot {slot} still names a key")
        if state is ChunkState.READY:
            evictable += 1
    if evictable != t.evictable:
        _fail(f"evictable count {t.evictable} != {evictable} READY slots")
    readable = {k for k, s in t.index.items() if t.state[s] != ChunkState.STORING}
    in_policy = set(policy)
    if len(in_policy) != len(policy):
        _fail("the policy holds a key twice")
    if in_policy != readable:
        _fail(f"policy holds {len(in_policy)} keys, {len(readable)} are readable")
    if len(admission) > admission.max_counters:
        _fail("admission counters exceed their bound")
