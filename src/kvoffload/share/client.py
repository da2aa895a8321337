"""The share's directory as one engine sees it: a
:class:`~kvoffload.core.directory.HostDirectory` (checked statically below), each call
one round trip to the node process (:mod:`.server`) but ``readable_prefix`` (the
index). Its queries are in :mod:`.queries`; the calls that book, complete and remove
are here.

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
- A scheduler half's directory binds its bookings to plans (``bind_plans``): every
  plan names the slab id its host slots are in (:meth:`ShareDirectory.seal_plan`),
  and a booking answered by a node process of another slab id is undone at once
  (a ``prepare_store`` answers ``no_room``, a ``prepare_load`` raises
  :class:`ShareUnavailable`) until the next plan (:mod:`.attachment`).

Ownership: the directory state lives in the node process; this object owns its
events, its :class:`~.attachment.Attachment` (its bookings, generation holds and
index view), its :class:`~.link.Link`, its :class:`~.lease.Lease` and its hold on
the share's ``users.lock`` (:mod:`.users`: ``kvoffload share remove`` refuses while
it is held). One thread calls it (the scheduler half's); the lease thread only tells
the attachment that a node process died.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from kvoffload.core.directory import EvictionHook, PreparedStore
from kvoffload.core.directory.directory import DIRECTORY_COUNTERS
from kvoffload.core.errors import ContractViolation
from kvoffload.core.keys import ChunkKey
from kvoffload.core.observe.events import CacheEvent, EventKind
from kvoffload.core.observe.recorder import CounterScope
from kvoffload.share.attachment import Attachment, Booking
from kvoffload.share.backing import Backing
from kvoffload.share.connection import Welcome
from kvoffload.share.lease import Lease
from kvoffload.share.link import CALL_TIMEOUT_S, Link
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.paths import SharePaths
from kvoffload.share.protocol import (
    FLAG_ADMIT_ALL,
    FLAG_GROUPS,
    Op,
    decode_prepared,
    pack_keys,
    pack_u32,
    unpack_keys,
    unpack_u32,
)
from kvoffload.share.queries import ShareCounts, ShareQueries, ShareUnavailable
from kvoffload.share.users import UsersHold

__all__ = ["ShareCounts", "ShareDirectory", "ShareUnavailable"]


class ShareDirectory(ShareQueries):
    """One engine's client of a share's directory (see the module docstring).

    ``geometry``: the share's shape if this engine may have to create it (its node
    process is started with it); ``session``: the engine's 16-byte id, shared with
    its workers' leases (default: random); ``namespace``: the engine's namespace
    label (scopes ``reset``); ``lease``: hold the session open from a thread of its
    own (turn it off in tests only: without a lease or a worker's, a timed-out call
    can end the session while transfers it booked are in flight); ``backing``: a backed
    share's (:mod:`.backing`), so that a node process this engine starts serves it;
    ``users``: hold the share's ``users.lock`` while open (an engine's process; an
    observer need not); ``fence``: hold the generation lock of each node process
    it attaches to (:mod:`.fence`; an observer that books nothing must not: it would
    keep the next node process fenced until its next call); ``bind_plans``: a
    scheduler half's (see the module docstring).
    Opening creates the share's directories if missing (:class:`ConfigError` naming
    ``host_share_root`` when another user made them).
    """

    def __init__(
        self,
        paths: SharePaths,
        *,
        geometry: ShareGeometry | None = None,
        session: bytes | None = None,
        namespace: bytes = b"",
        tier: str = "host",
        timeout_s: float = CALL_TIMEOUT_S,
        retry_s: float = 0.05,
        start_server: bool = True,
        lease: bool = True,
        backing: Backing | None = None,
        users: bool = True,
        fence: bool = True,
        bind_plans: bool = False,
    ) -> None:
        self.paths = paths
        self.tier = tier
        self.session = os.urandom(16) if session is None else session
        self.metrics = CounterScope.private(tier=tier)
        self.metrics.declare(*DIRECTORY_COUNTERS)
        self.on_evict: EvictionHook | None = None
        self.on_close: list[Callable[[], None]] = []  # run by close(), once
        self.attachment = Attachment(paths, bind_plans=bind_plans, fence=fence)
        self.users = UsersHold(paths) if users else None
        self._events: list[CacheEvent] = []
        self.link = Link(
            paths, self.session, namespace, geometry, timeout_s=timeout_s, retry_s=retry_s,
            start_server=start_server, on_connected=self._connected, backing=backing,
            users=self.users,
        )  # fmt: skip
        self.lease = (
            Lease(
                paths,
                self.session,
                retry_s=retry_s,
                on_lost=self._lost,
                on_found=self._found,
                users=self.users,
            )
            if lease
            else None
        )

    # ------------------------------------------------------------ connection life

    def _connected(self, welcome: Welcome) -> None:
        held = self.attachment.connected(welcome)
        if held is not None:  # bookings made by calls whose reply was lost are released
            storing, pins = held
            payload = struct.pack("<I", len(storing)) + pack_keys(storing) + pack_keys(pins)
            self.link.call(Op.SYNC, payload)

    def _lost(self, welcome: Welcome) -> None:
        self.attachment.lost(welcome)

    def _found(self, welcome: Welcome) -> None:
        if self.attachment.moved_to(welcome):
            self.link.note_moved()

    def saw_go(self, identity: tuple[int, bytes]) -> bool:
        """Whether this engine knows that the node process of ``identity`` is gone, or
        was never attached to it through its lease (its next call finds out then):
        a harness waits for this before the engine's next step."""
        leased = self.lease.welcome if self.lease is not None else None
        on_it = leased is not None and leased.identity == identity
        return self.attachment.identity != identity or not on_it

    def seal_plan(self) -> bytes | None:
        """The slab id the plan just built moves bytes of (its metadata names it for
        the workers); the next plan's bookings are bound to the node process attached
        now (see :mod:`.attachment`)."""
        return self.attachment.seal_plan()

    def wait_ready(self, timeout_s: float = 30.0) -> bool:
        """Connect now, waiting up to ``timeout_s`` for a node process this engine
        started (start-up and tests); whether connected."""
        return self.link.wait_ready(timeout_s)

    def close(self) -> None:
        """Close the connections (the node process releases this engine's bookings
        once its workers' leases close too) and the generation holds, then run
        :attr:`on_close` (what its opener attached to its life)."""
        self.link.close()
        if self.lease is not None:
            self.lease.close()
        self.attachment.close()
        if self.users is not None:
            self.users.release()
        for release in self.on_close:
            release()
        self.on_close.clear()

    # ------------------------------------------------------------ recency and admission

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        if keys:
            self.link.send(Op.TOUCH, pack_keys(keys))

    def record_lookups(self, keys: Iterable[ChunkKey]) -> None:
        listed = list(keys)
        if listed:
            self.link.send(Op.RECORD, pack_keys(listed))

    # ------------------------------------------------------------ loads

    def try_prepare_load(self, keys: Sequence[ChunkKey]) -> tuple[int, ...] | None:
        """Pin every key and return their slots, or None (nothing pinned) when the
        share did not answer or a key is no longer a hit."""
        try:
            return self.prepare_load(keys)
        except (ShareUnavailable, ContractViolation):
            return None

    def prepare_load(self, keys: Sequence[ChunkKey]) -> tuple[int, ...]:
        """Pin every key (each must be a HIT) and return their slots, in order (none:
        no call)."""
        if not keys:
            return ()
        reply = self.link.call(Op.PREPARE_LOAD, pack_keys(keys))
        if reply is None:
            raise ShareUnavailable("host share: prepare_load unanswered")
        booked = self.attachment.book_pins(self.link.welcome, keys)
        if booked is Booking.DEAD:
            raise ShareUnavailable("host share: the node process died while answering")
        if booked is Booking.OFF_PLAN:
            self.complete_load(keys)
            raise ShareUnavailable("host share: pinned in another slab than the plan's")
        return tuple(unpack_u32(reply))

    def complete_load(self, keys: Sequence[ChunkKey]) -> None:
        """Drop one pin per key. A pin the node process no longer holds (it restarted)
        is settled here; an unanswered call is settled at the next connection."""
        booked, send = self.attachment.start_completing(keys, loads=True)
        if not send:
            return
        if any(booked.pins[key] < n for key, n in _counts(send).items()):
            raise ContractViolation(f"{self.tier}: complete_load of a chunk that is not pinned")
        self.link.call(Op.COMPLETE_LOAD, pack_keys(send))
        self.attachment.completed(booked, send, loads=True)

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
        new, slots, evicted, refused, no_room = decode_prepared(reply)
        prepared = PreparedStore(
            tuple(keys[i] for i in new), tuple(slots), tuple(evicted),
            tuple(keys[i] for i in refused), no_room,
        )  # fmt: skip
        booked = self.attachment.book_stores(self.link.welcome, prepared.keys)
        if booked is Booking.DEAD:
            self.metrics.count("no_room_total")  # answered by a node process now dead
            return PreparedStore(no_room=True)
        if booked is Booking.OFF_PLAN:  # slots of another slab than the plan's: undone
            if prepared.keys:
                self.complete_store(prepared.keys, success=False)
            self._count(replace(prepared, keys=(), slots=(), refused=(), no_room=True))
            return PreparedStore(no_room=True)
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
        booked, send = self.attachment.start_completing(keys, loads=False)
        if not send:
            return
        if len(set(send)) != len(send) or any(key not in booked.storing for key in send):
            raise ContractViolation(f"{self.tier}: complete_store of a chunk not being stored")
        reply = self.link.call(Op.COMPLETE_STORE, bytes([success]) + pack_keys(send))
        self.attachment.completed(booked, send, loads=False)
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


def _counts(keys: Sequence[ChunkKey]) -> dict[ChunkKey, int]:
    counts: dict[ChunkKey, int] = {}
    for key in keys:
        counts[key] = counts.get(key, 0) + 1
    return counts


if TYPE_CHECKING:
    from kvoffload.core.directory import HostDirectory

    _conforms: type[HostDirectory] = ShareDirectory
