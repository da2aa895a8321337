"""The manual worker's lower tiers: chunks in memory, slot-addressed like the disk tier.

:class:`MemoryTiers` holds, per tier name, ``tier slot -> (chunk key, bytes, KV cache
group)``. It is authoritative, as the disk tier's slab is: a read of a slot that does
not hold the chunk the job names, or holds it as another group, or with other bytes
than a store captured, is an :class:`InvariantViolation` (the scheduler half reused a
tier slot while it was still needed, or lost track of a chunk). A slot marked with
:meth:`MemoryTiers.damage` reads as torn: the read reports it (None) and the tier
drops the chunk, as the disk tier clears a slot whose checksum fails. A dropped slot
is remembered with the chunk it held and the job whose read dropped it until the
next write: a job planned before the scheduler half applied that job's report (two
tier loads of one prefix, the second planned while the first's failure was still on
its way) finds the chunk gone (None), as a read of a cleared disk slot does, and that
is no violation; a job planned after (:meth:`MemoryTiers.acknowledged`) that reads it
is one.

Owned by one :class:`~kvoffload.engine.manual_worker.ManualWorker`, which borrows it
the bytes every verified store captured (``known``) and calls it from its one thread.
"""

from __future__ import annotations

from kvoffload.core.errors import ContractViolation
from kvoffload.core.keys import ChunkKey

TORN_BYTES = b"\xcc"
"""What a failed spill leaves in its tier slot: never readable as a chunk."""


class InvariantViolation(AssertionError):
    """A promise of the scheduler half was broken (found by a check, not a crash)."""


class MemoryTiers:
    def __init__(self, known: dict[ChunkKey, bytes]) -> None:
        self.known = known  # borrowed: chunk key -> the bytes a verified store captured
        self.slots: dict[str, dict[int, tuple[ChunkKey, bytes, int]]] = {}
        self.damaged: set[tuple[str, int]] = set()  # (tier, tier slot): reads as torn
        # dropped since its last write: [its chunk, the job that dropped it, the newest
        # job id planned when that job's report was applied (None: not yet)]
        self.cleared: dict[tuple[str, int], tuple[ChunkKey, int, int | None]] = {}

    def write(self, tier: str, tier_slot: int, key: ChunkKey, data: bytes, group: int) -> None:
        """A spill's write of ``key`` (its ``data``, as ``group``) into ``tier_slot``;
        a failed spill writes :data:`TORN_BYTES`. Either overwrites a damaged slot."""
        self.slots.setdefault(tier, {})[tier_slot] = (key, data, group)
        self.damaged.discard((tier, tier_slot))
        self.cleared.pop((tier, tier_slot), None)

    def read(
        self, what: str, tier: str, tier_slot: int, key: ChunkKey, group: int, *, job_id: int = -1
    ) -> bytes | None:
        """The bytes of ``key`` in ``tier_slot`` as job ``job_id`` (a promotion or a
        tier load; ``what`` names it in messages) reads them, checked (see the module
        docstring); None when the slot is damaged (the chunk is dropped) or was dropped
        while the job was in flight."""
        stored = self.slots.get(tier, {}).get(tier_slot)
        gone = self.cleared.get((tier, tier_slot))
        if (
            stored is None
            and gone is not None
            and gone[0] == key
            and (gone[2] is None or job_id <= gone[2])
        ):
            return None  # dropped by another read of it: gone, as a cleared disk slot
        if stored is None or stored[0] != key:
            raise InvariantViolation(
                f"{what} reads tier {tier!r} slot {tier_slot}, which does not hold its chunk"
            )
        if stored[2] != group:
            raise InvariantViolation(
                f"{what} expects group {group} of a chunk spilled as group {stored[2]}"
            )
        if (tier, tier_slot) in self.damaged:
            self.drop(tier, tier_slot, by=job_id)
            return None
        if stored[1] != self.known.get(key):
            raise InvariantViolation(f"{what} found wrong bytes in tier")
        return stored[1]

    def damage(self, tier: str, tier_slot: int) -> None:
        """Tear the chunk in ``tier_slot`` of ``tier`` (it must hold one: else a
        :class:`ContractViolation`, a test's mistake): its next read finds it bad."""
        if tier_slot not in self.slots.get(tier, {}):
            raise ContractViolation(f"tier {tier!r} slot {tier_slot} holds no chunk to damage")
        self.damaged.add((tier, tier_slot))

    def drop(self, tier: str, tier_slot: int, *, by: int = -1) -> None:
        """Forget the chunk in ``tier_slot`` (job ``by`` found its copy bad)."""
        stored = self.slots.get(tier, {}).pop(tier_slot, None)
        if stored is not None:
            self.cleared[(tier, tier_slot)] = (stored[0], by, None)
        self.damaged.discard((tier, tier_slot))

    def acknowledged(self, job_id: int, newest: int) -> None:
        """The scheduler half applied job ``job_id``'s report; ``newest``: the newest
        job id planned so far (jobs after it know the chunks that job dropped)."""
        for place, (key, by, limit) in self.cleared.items():
            if by == job_id and limit is None:
                self.cleared[place] = (key, by, newest)
