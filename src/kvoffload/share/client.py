"""The share's directory as one engine sees it: the interface of
:class:`~kvoffload.core.directory.Directory` that the scheduler half uses, each call
one round trip to the node process (:mod:`.server`).

A slow or unreachable share never stalls a step and never raises into it: a call the
share does not answer within the link's ``timeout_s`` answers as the share being
empty and full (lookups miss, ``prepare_store`` says ``no_room``, counts are 0,
``touch``/``record_lookups``/``discard`` do nothing), counted in ``link.stats``. Two
calls cannot answer that way, since their contract has no miss:
:meth:`ShareDirectory.prepare_load` (and ``slots_of``/``groups_of``) raise
:class:`ShareUnavailable` (:meth:`try_prepare_load` answers None instead). A
``prepare_load`` can also lose a race that a private directory never loses: another
engine may evict a chunk between this engine's lookup and its load (a
:class:`ContractViolation`, nothing changed; ``try_prepare_load``: None).

What differs from a private directory, by design:

- ``pinned_count`` and ``storing_count`` count this engine's bookings only (what its
  own in-flight jobs account for); ``free_slots``, ``evictable_count``,
  ``used_slots`` and ``len`` describe the whole share.
- Events (``take_events``) and the ``on_evict`` hook report what this engine's own
  calls did: its stores, the evictions its stores caused, its discards and resets.
- ``reset`` discards the chunks of this engine's namespace only.
- Completions of bookings made under a node process that has since died are settled
  here and never sent (:mod:`.bookings`); after a reconnection to the same node
  process, bookings whose reply was lost are released (a SYNC call).
- ``restore`` is not offered (a share starts empty, see :mod:`.server`).

Ownership: the directory state lives in the node process; this object owns the
engine's view of its own bookings (:class:`~.bookings.Bookings`), its events, its
generation hold (:mod:`.fence`) and its :class:`~.link.Link` and
:class:`~.link.Lease`. One thread calls it (the scheduler half's); the lease thread
only moves bookings to stale, under ``_guard``.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvoffload.core.chunk_state import ChunkState
from kvoffload.core.directory import LookupResult, LookupStatus, PreparedStore
from kvoffload.core.directory.directory import DIRECTORY_COUNTERS
from kvoffload.core.errors import ContractViolation, KvOffloadError
from kvoffload.core.events import CacheEvent, EventKind
from kvoffload.core.keys import ChunkKey
from kvoffload.core.recorder import CounterScope
from kvoffload.share.bookings import Bookings
from kvoffload.share.fence import GenerationHold
from kvoffload.share.geometry import ShareGeometry
from kvoffload.share.index import IndexReader
from kvoffload.share.link import Lease, Link, Welcome
from kvoffload.share.paths import SharePaths
from kvoffload.share.protocol import (
    FLAG_ADMIT_ALL,
    FLAG_GROUPS,
    STATES,
    STATS,
    Op,
    decode_prepared,
    pack_keys,
    pack_u32,
    unpack_keys,
    unpack_u32,
)

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


class ShareUnavailable(KvOffloadError):
    """The share did not answer a call whose contract has no miss (prepare_load,
    slots_of, groups_of). The engine should treat the load as failed (recompute)."""


class ShareDirectory:
    """One engine's client of a share's directory (see the module docstring).

    ``geometry``: the share's shape if this engine may have to create it (its node
    process is started with it); ``session``: the engine's 16-byte id, shared with
    its workers' leases (default: random); ``namespace``: the engine's namespace
    label (scopes ``reset``).
    """

    def __init__(
        self,
        paths: SharePaths,
        *,
        geometry: ShareGeometry | None = None,
        session: bytes | None = None,
        namespace: bytes = b"",
        tier: str = "host",
        timeout_s: float = 0.005,
        retry_s: float = 0.05,
        start_server: bool = True,
        lease: bool = True,
    ) -> None:
        self.paths = paths
        self.tier = tier
        self.session = os.urandom(16) if session is None else session
        self.metrics = CounterScope.private(tier=tier)
        self.metrics.declare(*DIRECTORY_COUNTERS)
        self.on_evict: Callable[[tuple[ChunkKey, ...]], None] | None = None
        self.bookings = Bookings()
        self._guard = threading.Lock()
        self._events: list[CacheEvent] = []
        self._generation: int | None = None  # of the node process the bookings are with
        self._holds: list[GenerationHold] = []
        self._index: IndexReader | None = None
        self.link = Link(
            paths, self.session, namespace, geometry, timeout_s=timeout_s, retry_s=retry_s,
            start_server=start_server, on_connected=self._connected,
        )  # fmt: skip
        self.lease = (
            Lease(paths, self.session, retry_s=retry_s, on_lost=self._lost) if lease else None
        )

    # ------------------------------------------------------------ connection life

    def _connected(self, welcome: Welcome) -> None:
        with self._guard:
            same = welcome.generation == self._generation and not welcome.fresh
            if not same:
                self.bookings.lose_current()
                if all(h.generation != welcome.generation for h in self._holds):
                    self._holds.append(GenerationHold(self.paths, welcome.generation))
            self._generation = welcome.generation
            self._release_drained()
            if self._index is None:
                self._index = _open_index(self.paths)
            current = self.bookings.current
            storing, pins = list(current.storing), list(current.pins.elements())
        if same:  # bookings made by calls whose reply was lost are released
            payload = struct.pack("<I", len(storing)) + pack_keys(storing) + pack_keys(pins)
            self.link.call(Op.SYNC, payload)

    def _lost(self, generation: int) -> None:
        """The lease saw generation ``generation``'s node process go (lease thread)."""
        with self._guard:
            if generation == self._generation:
                self.bookings.lose_current()
                self._generation = None
            self._release_drained()

    def _release_drained(self) -> None:
        """Release the holds of generations this engine has no transfer with any more
        (under ``_guard``)."""
        if self.bookings.stale:
            return
        keep = []
        for hold in self._holds:
            if hold.generation == self._generation:
                keep.append(hold)
            else:
                hold.release()
        self._holds = keep

    def _answered_live(self) -> bool:
        """Whether the node process that just answered is still this engine's (under
        ``_guard``): one the lease saw die meanwhile booked nothing a transfer may use
        (its successor could hand the same slots out)."""
        welcome = self.link.welcome
        return welcome is not None and welcome.generation == self._generation

    def wait_ready(self, timeout_s: float = 30.0) -> bool:
        """Connect now, waiting up to ``timeout_s`` for a node process this engine
        started (start-up and tests); whether connected."""
        return self.link.wait_ready(timeout_s)

    def close(self) -> None:
        """Close the connections (the node process releases this engine's bookings
        once its workers' leases close too) and the generation holds."""
        self.link.close()
        if self.lease is not None:
            self.lease.close()
        with self._guard:
            for hold in self._holds:
                hold.release()
            self._holds = []

    # ------------------------------------------------------------ queries

    def lookup(self, keys: Sequence[ChunkKey]) -> LookupResult:
        reply = self.link.call(Op.LOOKUP, pack_keys(keys)) if keys else b""
        if reply is None:
            return LookupResult((LookupStatus.MISS,) * len(keys), 0)
        statuses = tuple(_STATUSES[code] for code in reply)
        prefix = next((i for i, s in enumerate(statuses) if s is not LookupStatus.HIT), len(keys))
        return LookupResult(statuses, prefix)

    def readable_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """From the share's index when it is of the node process this engine is
        connected to (no round trip; advisory, as every hit is: ``prepare_load``
        confirms it), else one call."""
        if not keys:
            return 0
        index, generation = self._index, self._generation
        if (
            index is not None
            and self.link.connected
            and index.generation == generation
            and self.link.server_alive()
        ):
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
        rows = self._states([key])
        return None if rows is None or rows[0][2] < 0 else rows[0][2]

    def slots_of(self, keys: Sequence[ChunkKey]) -> tuple[int, ...]:
        rows = self._states(keys)
        if rows is None:
            raise ShareUnavailable("host share: slots_of unanswered")
        if any(slot < 0 for _, _, slot in rows):
            raise ContractViolation(f"{self.tier}: slots_of a chunk that is not present")
        return tuple(slot for _, _, slot in rows)

    def groups_of(self, slots: Sequence[int]) -> tuple[int, ...]:
        reply = self.link.call(Op.GROUPS, pack_u32(slots))
        if reply is None:
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
        return self.bookings.storing_count

    @property
    def pinned_count(self) -> int:
        """Pins this engine holds."""
        return self.bookings.pin_count

    def __len__(self) -> int:
        return self._stats()[5]

    def __contains__(self, key: object) -> bool:
        if not isinstance(key, bytes):
            return False
        return self.state_of(ChunkKey(key)) is not ChunkState.FREE

    # ------------------------------------------------------------ recency and admission

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        if keys:
            self.link.call(Op.TOUCH, pack_keys(keys))

    def record_lookups(self, keys: Iterable[ChunkKey]) -> None:
        listed = list(keys)
        if listed:
            self.link.call(Op.RECORD, pack_keys(listed))

    # ------------------------------------------------------------ loads

    def try_prepare_load(self, keys: Sequence[ChunkKey]) -> tuple[int, ...] | None:
        """Pin every key and return their slots, or None (nothing pinned) when the
        share did not answer or a key is no longer a hit."""
        try:
            return self.prepare_load(keys)
        except (ShareUnavailable, ContractViolation):
            return None

    def prepare_load(self, keys: Sequence[ChunkKey]) -> tuple[int, ...]:
        """Pin every key (each must be a HIT) and return their slots, in order."""
        reply = self.link.call(Op.PREPARE_LOAD, pack_keys(keys))
        if reply is None:
            raise ShareUnavailable("host share: prepare_load unanswered")
        with self._guard:
            live = self._answered_live()
            if live:
                self.bookings.current.pins.update(keys)
        if not live:
            raise ShareUnavailable("host share: the node process died while answering")
        return tuple(unpack_u32(reply))

    def complete_load(self, keys: Sequence[ChunkKey]) -> None:
        """Drop one pin per key. A pin the node process no longer holds (it restarted)
        is settled here; an unanswered call is settled at the next connection."""
        with self._guard:
            send = self.bookings.settle_loads(keys)
            self._release_drained()
        if not send:
            return
        booked = self.bookings.current
        if any(booked.pins[key] < n for key, n in _counts(send).items()):
            raise ContractViolation(f"{self.tier}: complete_load of a chunk that is not pinned")
        self.link.call(Op.COMPLETE_LOAD, pack_keys(send))
        with self._guard:  # done either way: unsent pins are released by the next SYNC
            if self.bookings.current is booked:
                booked.pins.subtract(send)
                for key in set(send):
                    if booked.pins[key] <= 0:
                        del booked.pins[key]
            else:  # the lease moved them to stale meanwhile
                self.bookings.settle_loads(send)
            self._release_drained()

    # ------------------------------------------------------------ stores

    def prepare_store(
        self,
        keys: Sequence[ChunkKey],
        *,
        admit_all: bool = False,
        groups: Sequence[int] | None = None,
    ) -> PreparedStore:
        """As :meth:`Directory.prepare_store`; an unanswered call is ``no_room``."""
        if groups is not None and len(groups) != len(keys):
            raise ContractViolation(f"{self.tier}: prepare_store needs one group per key")
        flags = (FLAG_ADMIT_ALL if admit_all else 0) | (FLAG_GROUPS if groups is not None else 0)
        payload = struct.pack("<BI", flags, len(keys)) + pack_keys(keys)
        reply = self.link.call(Op.PREPARE_STORE, payload + pack_u32(groups or ()))
        if reply is None:
            self.metrics.count("no_room_total")
            return PreparedStore(no_room=True)
        with self._guard:
            live = self._answered_live()
        if not live:
            self.metrics.count("no_room_total")
            return PreparedStore(no_room=True)
        new, slots, evicted, refused, no_room = decode_prepared(reply)
        prepared = PreparedStore(
            tuple(keys[i] for i in new), tuple(slots), tuple(evicted),
            tuple(keys[i] for i in refused), no_room,
        )  # fmt: skip
        with self._guard:
            self.bookings.current.storing.update(dict.fromkeys(prepared.keys))
        self._count(prepared)
        return prepared

    def _count(self, prepared: PreparedStore) -> None:
        if prepared.refused:
            self.metrics.count("admission_refusals_total", len(prepared.refused))
        if prepared.no_room:
            self.metrics.count("no_room_total")
        if prepared.evicted:
            self.metrics.count("evictions_total", len(prepared.evicted))
            self._events.append(CacheEvent(EventKind.REMOVED, prepared.evicted, self.tier))
            if self.on_evict is not None:
                self.on_evict(prepared.evicted)

    def complete_store(self, keys: Sequence[ChunkKey], success: bool) -> None:
        """READY on success, freed on failure. A store booked under a node process that
        has since restarted is settled here (never readable); an unanswered call
        leaves its chunks unreadable and is settled at the next connection."""
        with self._guard:
            send = self.bookings.settle_stores(keys)
            self._release_drained()
        if not send:
            return
        booked = self.bookings.current
        if len(set(send)) != len(send) or any(key not in booked.storing for key in send):
            raise ContractViolation(f"{self.tier}: complete_store of a chunk not being stored")
        reply = self.link.call(Op.COMPLETE_STORE, bytes([success]) + pack_keys(send))
        with self._guard:  # done either way: unsent stores are failed by the next SYNC
            if self.bookings.current is booked:
                for key in send:
                    del booked.storing[key]
            else:  # the lease moved them to stale meanwhile
                self.bookings.settle_stores(send)
            self._release_drained()
        if reply:
            stored = tuple(send[i] for i in unpack_u32(reply))
            self._events.append(CacheEvent(EventKind.STORED, stored, self.tier))

    # ------------------------------------------------------------ removal

    def discard(self, keys: Iterable[ChunkKey]) -> list[ChunkKey]:
        listed = list(keys)
        reply = self.link.call(Op.DISCARD, pack_keys(listed)) if listed else None
        if not reply:
            return []
        removed = [listed[i] for i in unpack_u32(reply)]
        self._events.append(CacheEvent(EventKind.REMOVED, tuple(removed), self.tier))
        return removed

    def reset(self) -> list[ChunkKey]:
        """Discard every chunk of this engine's namespace; forget admission counters."""
        reply = self.link.call(Op.RESET)
        removed = [] if reply is None else unpack_keys(reply)
        if removed:
            self._events.append(CacheEvent(EventKind.REMOVED, tuple(removed), self.tier))
        return removed

    def restore(self, entries: Sequence[tuple[ChunkKey, int]]) -> None:
        raise ContractViolation(f"{self.tier}: a host share is never restored (it starts empty)")

    def take_events(self) -> list[CacheEvent]:
        events, self._events = self._events, []
        return events

    def check_integrity(self) -> None:
        """The node process's invariants (its directory, and the sessions' bookings
        against it); nothing when it does not answer."""
        self.link.call(Op.CHECK)


def _open_index(paths: SharePaths) -> IndexReader | None:
    try:
        return IndexReader(paths.index)
    except (OSError, ValueError):
        return None


def _counts(keys: Sequence[ChunkKey]) -> dict[ChunkKey, int]:
    counts: dict[ChunkKey, int] = {}
    for key in keys:
        counts[key] = counts.get(key, 0) + 1
    return counts
