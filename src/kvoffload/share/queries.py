"""The side-effect-free calls of a share's directory (:class:`ShareQueries`, the base
of :class:`~kvoffload.share.client.ShareDirectory`), and what they answer.

Each is one round trip to the node process, except ``readable_prefix`` (the share's
index, :mod:`.index`, when it is the attached node process's and that process holds
the server lock) and the two counts of this engine's own bookings. Unanswered, each
answers as an empty, full share (a miss, 0, FREE, None), except ``slots_of`` and
``groups_of`` (:class:`ShareUnavailable`).

The slots a plan moves bytes of (``slot_of``, ``slots_of``, ``groups_of``) are those
of the plan's slab (:mod:`.attachment`): asked of a node process of another slab id
they are unanswered. And a chunk this engine pins only under a node process since
lost has no slot: the node process attached now may hold that key (stored again by
another engine) in a slot this engine has not pinned.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvoffload.core.chunk_state import ChunkState
from kvoffload.core.directory import LookupResult, LookupStatus
from kvoffload.core.errors import ContractViolation, DirectoryUnavailable
from kvoffload.core.keys import ChunkKey
from kvoffload.share.attachment import Attachment
from kvoffload.share.link import Link
from kvoffload.share.protocol import STATES, STATS, Op, pack_keys, pack_u32, unpack_keys, unpack_u32

_STATUSES = (LookupStatus.MISS, LookupStatus.HIT, LookupStatus.HIT_PENDING)


@dataclass(frozen=True)
class ShareCounts:
    """The whole share now, as its node process counts it."""

    num_slots: int
    free: int
    evictable: int
    storing: int  # slots being stored, by every engine
    pinned: int  # pins held, by every engine
    chunks: int  # chunks present
    sessions: int  # engines connected
    fenced_stores: int  # prepare_store calls refused until older generations drained


class ShareUnavailable(DirectoryUnavailable):
    """The share did not answer a call whose contract has no miss (prepare_load,
    slots_of, groups_of). The engine should treat the load as failed (recompute)."""


class ShareQueries:
    """Queries of one engine's view of a share (see the module docstring); the
    subclass sets ``link``, ``attachment`` and ``tier``."""

    link: Link
    attachment: Attachment
    tier: str

    def lookup(self, keys: Sequence[ChunkKey]) -> LookupResult:
        reply = self.link.call(Op.LOOKUP, pack_keys(keys)) if keys else b""
        if reply is None:
            return LookupResult((LookupStatus.MISS,) * len(keys), 0)
        statuses = tuple(map(_STATUSES.__getitem__, reply))
        return LookupResult(statuses, len(reply) - len(reply.lstrip(b"\x01")))

    def readable_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """From the share's index when it is of the node process this engine is
        connected to (no round trip; advisory, as every hit is: ``prepare_load``
        confirms it), else one call."""
        if not keys:
            return 0
        index = self.attachment.index()
        if index is not None and self.link.connected and self.link.server_alive():
            return index.readable_prefix(keys)
        reply = self.link.call(Op.PREFIX, pack_keys(keys))
        return 0 if reply is None else int(struct.unpack("<I", reply)[0])

    def present_keys(self) -> list[ChunkKey]:
        reply = self.link.call(Op.PRESENT)
        return [] if reply is None else unpack_keys(reply)

    def _states(self, keys: Sequence[ChunkKey]) -> list[tuple[int, int, int]] | None:
        reply = self.link.call(Op.STATES, pack_keys(keys))
        if reply is None:
            return None
        rows: list[tuple[int, int, int]] = np.frombuffer(reply, dtype=STATES).tolist()
        return rows

    def state_of(self, key: ChunkKey) -> ChunkState:
        rows = self._states([key])
        return ChunkState.FREE if rows is None else ChunkState(rows[0][0])

    def pins_of(self, key: ChunkKey) -> int:
        """Pins on ``key`` held by every engine."""
        rows = self._states([key])
        return 0 if rows is None else rows[0][1]

    def slot_of(self, key: ChunkKey) -> int | None:
        rows = self._slots_rows([key])
        if rows is None or rows[0][2] < 0 or self.attachment.stale_only([key]):
            return None
        return rows[0][2]

    def slots_of(self, keys: Sequence[ChunkKey]) -> tuple[int, ...]:
        rows = self._slots_rows(keys)
        if rows is None:
            raise ShareUnavailable("host share: slots_of unanswered")
        if any(slot < 0 for _, _, slot in rows) or self.attachment.stale_only(keys):
            raise ContractViolation(f"{self.tier}: slots_of a chunk that is not present")
        return tuple(slot for _, _, slot in rows)

    def _slots_rows(self, keys: Sequence[ChunkKey]) -> list[tuple[int, int, int]] | None:
        """:meth:`_states`, answered by a node process of the plan's slab (None
        otherwise)."""
        rows = self._states(keys)
        return rows if self.attachment.on_plan(self.link.welcome) else None

    def groups_of(self, slots: Sequence[int]) -> tuple[int, ...]:
        reply = self.link.call(Op.GROUPS, pack_u32(slots))
        if reply is None or not self.attachment.on_plan(self.link.welcome):
            raise ShareUnavailable("host share: groups_of unanswered")
        return tuple(unpack_u32(reply))

    def _stats(self) -> tuple[int, ...]:
        reply = self.link.call(Op.STATS)
        return (0,) * 8 if reply is None else STATS.unpack(reply)

    def share_counts(self) -> ShareCounts | None:
        """The whole share's counts, or None when it does not answer."""
        reply = self.link.call(Op.STATS)
        return None if reply is None else ShareCounts(*STATS.unpack(reply))

    @property
    def num_slots(self) -> int:
        return self._stats()[0]

    @property
    def free_slots(self) -> int:
        return self._stats()[1]

    @property
    def used_slots(self) -> int:
        stats = self._stats()
        return stats[0] - stats[1]

    @property
    def evictable_count(self) -> int:
        return self._stats()[2]

    @property
    def storing_count(self) -> int:
        """Slots this engine is storing (live or discarded)."""
        return self.attachment.bookings.storing_count

    @property
    def pinned_count(self) -> int:
        """Pins this engine holds."""
        return self.attachment.bookings.pin_count

    def __len__(self) -> int:
        return self._stats()[5]

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, bytes):
            return False
        return self.state_of(ChunkKey(key)) is not ChunkState.FREE

    def check_integrity(self) -> None:
        """The node process's invariants (its directory, and the sessions' bookings
        against it); nothing when it does not answer."""
        self.link.call(Op.CHECK)
