"""The node process's bookkeeping: one :class:`Directory` shared by every engine,
and which engine (session) holds which pin and which slot being stored.

Ownership: the :class:`ShareBook` holds, and alone mutates, the directory, the
sessions and the namespace of each present chunk; the server loop calls it, one
call at a time (it does no locking).

Sessions and fencing: every engine is one session (a 16-byte id its scheduler half
and its workers share), open while any of its connections is. A completion names
chunks its own session booked, else it is a :class:`ContractViolation` and changes
nothing: an engine cannot complete (or make readable) what another engine, or an
earlier life of itself, is storing. When a session's last connection closes (its
processes exited or were killed), :meth:`ShareBook.close_session` drops its pins and
frees every slot it was still storing, never making one readable: a half-written
chunk is never served. No process of the engine is alive any more by then (each
worker holds a connection of its own), so nothing can still be writing those slots.

The readable set is mirrored into the share's index (:mod:`.index`) as it changes:
chunks made readable by ``complete_store`` are inserted, chunks evicted, discarded or
reset are removed, before the call's reply is sent. Its removals also go to the
announcement feed (:mod:`.feed`), which keeps the records engines announce chunks by.

Generations: a node process restarted after a crash starts with an empty directory
(slab bytes are never trusted without the index). Until ``fence_open`` says every
engine of the earlier generations has finished its transfers (see :mod:`.fence`),
it books no slot: ``prepare_store`` answers ``no_room``.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvoffload.core.chunk_state import ChunkState
from kvoffload.core.directory import Directory, LookupStatus, PreparedStore
from kvoffload.core.errors import ContractViolation
from kvoffload.core.keys import ChunkKey
from kvoffload.share.feed import ShareFeed
from kvoffload.share.index import IndexWriter

_STATUS_CODES = {LookupStatus.MISS: 0, LookupStatus.HIT: 1, LookupStatus.HIT_PENDING: 2}


@dataclass
class Session:
    """One engine: its namespace label, open connections and bookings."""

    namespace: bytes
    connections: int = 0
    pins: Counter[ChunkKey] = field(default_factory=Counter)
    storing: dict[ChunkKey, None] = field(default_factory=dict)


class ShareBook:
    """The shared directory and its sessions (see the module docstring)."""

    def __init__(
        self,
        directory: Directory,
        fence_open: Callable[[], bool] | None = None,
        index: IndexWriter | None = None,
        feed: ShareFeed | None = None,
    ) -> None:
        self.directory = directory
        self.index = index
        # Epoch: random per node process, never 0 (a reader's cursor before its first read).
        self.feed = feed if feed is not None else ShareFeed(int.from_bytes(os.urandom(8)) | 1)
        self.sessions: dict[bytes, Session] = {}
        self._namespace_of: dict[ChunkKey, bytes] = {}
        self._fence_open = fence_open
        self.fenced_stores = 0  # prepare_store calls answered no_room by the fence

    # ------------------------------------------------------------------ sessions

    def open_session(self, sid: bytes, namespace: bytes | None) -> bool:
        """Count one more connection of session ``sid``; True if it is new. A
        scheduler half's connection names the session's namespace (a lease's, None)."""
        session = self.sessions.get(sid)
        fresh = session is None
        if session is None:
            session = self.sessions[sid] = Session(b"")
        if namespace is not None:
            session.namespace = namespace
        session.connections += 1
        return fresh

    def close_session(self, sid: bytes) -> None:
        """One connection of ``sid`` closed; at the last, release its bookings."""
        session = self.sessions.get(sid)
        if session is None:
            return
        session.connections -= 1
        if session.connections > 0:
            return
        del self.sessions[sid]
        if session.pins:
            self.directory.complete_load(list(session.pins.elements()))
        if session.storing:
            self._fail_stores(list(session.storing))
        self.directory.take_events()

    def sync(self, session: Session, storing: Sequence[ChunkKey], pins: Sequence[ChunkKey]) -> None:
        """The engine holds exactly ``storing`` and ``pins``: release any other booking
        of its session (made by a call whose reply it never received)."""
        keep = set(storing)
        lost = [key for key in session.storing if key not in keep]
        if lost:
            self._fail_stores(lost)
        extra = session.pins - Counter(pins)
        if extra:
            self.directory.complete_load(list(extra.elements()))
            session.pins -= extra

    def restore(self, entries: Sequence[tuple[ChunkKey, int]], namespace: bytes) -> None:
        """Adopt chunks found in storage (a backed share's recovery, before any booking):
        each ``(key, slot)`` readable, least recently used first, of ``namespace``."""
        self.directory.restore(entries)
        for key, _ in entries:
            self._namespace_of[key] = namespace
        if self.index is not None and entries:
            self.index.insert(key for key, _ in entries)
        self.directory.take_events()

    # ------------------------------------------------------------------ queries

    def lookup(self, keys: Sequence[ChunkKey]) -> bytes:
        return bytes(map(_STATUS_CODES.__getitem__, self.directory.lookup(keys).statuses))

    def states(self, keys: Sequence[ChunkKey]) -> list[tuple[int, int, int]]:
        d = self.directory
        result = []
        for key in keys:
            slot = d.slot_of(key)
            result.append((int(d.state_of(key)), d.pins_of(key), -1 if slot is None else slot))
        return result

    # ------------------------------------------------------------------ loads

    def prepare_load(self, session: Session, keys: Sequence[ChunkKey]) -> tuple[int, ...]:
        slots = self.directory.prepare_load(keys)
        session.pins.update(keys)
        return slots

    def complete_load(self, session: Session, keys: Sequence[ChunkKey]) -> None:
        wanted = Counter(keys)
        if any(session.pins[key] < n for key, n in wanted.items()):
            raise ContractViolation("host share: complete_load of a chunk this engine did not pin")
        self.directory.complete_load(keys)
        session.pins -= wanted

    # ------------------------------------------------------------------ stores

    def prepare_store(
        self,
        session: Session,
        keys: Sequence[ChunkKey],
        admit_all: bool,
        groups: Sequence[int] | None,
    ) -> PreparedStore:
        if self._fence_open is not None:
            if not self._fence_open():
                self.fenced_stores += 1
                return PreparedStore(no_room=True)
            self._fence_open = None
        prepared = self.directory.prepare_store(keys, admit_all=admit_all, groups=groups)
        for key in prepared.keys:
            session.storing[key] = None
            self._namespace_of[key] = session.namespace
        for key in prepared.evicted:
            self._namespace_of.pop(key, None)
        if prepared.evicted:
            self._unreadable(prepared.evicted)
        self.directory.take_events()
        return prepared

    def complete_store(
        self, session: Session, keys: Sequence[ChunkKey], success: bool
    ) -> list[int]:
        """Indices of the ``keys`` that became readable."""
        if len(set(keys)) != len(keys):
            raise ContractViolation("host share: complete_store names a chunk twice")
        if any(key not in session.storing for key in keys):
            raise ContractViolation(
                "host share: complete_store of a chunk this engine is not storing"
            )
        self.directory.complete_store(keys, success)
        for key in keys:
            del session.storing[key]
        self.directory.take_events()
        stored = [i for i, key in enumerate(keys) if self._settle(key)]
        if self.index is not None and stored:
            self.index.insert(keys[i] for i in stored)
        return stored

    def _fail_stores(self, keys: list[ChunkKey]) -> None:
        self.directory.complete_store(keys, success=False)
        for session in self.sessions.values():
            for key in keys:
                session.storing.pop(key, None)
        for key in keys:
            self._settle(key)

    def _settle(self, key: ChunkKey) -> bool:
        """After a completion: whether ``key`` is readable; forget its namespace if not."""
        if self.directory.state_of(key) in (ChunkState.READY, ChunkState.PINNED):
            return True
        if key not in self.directory:
            self._namespace_of.pop(key, None)
        return False

    # ------------------------------------------------------------------ removal

    def discard(self, keys: Sequence[ChunkKey]) -> list[int]:
        """Indices of the ``keys`` that were readable."""
        removed = set(self.directory.discard(keys))
        for key in keys:
            self._namespace_of.pop(key, None)
        if removed:
            self._unreadable(removed)
        self.directory.take_events()
        first = {key: i for i, key in reversed(list(enumerate(keys)))}
        return sorted(first[key] for key in removed)

    def reset(self, session: Session) -> list[ChunkKey]:
        """Discard every chunk of ``session``'s namespace (other namespaces keep
        theirs) and forget the admission counters; the chunks that were readable."""
        mine = [k for k, ns in self._namespace_of.items() if ns == session.namespace]
        removed = self.directory.discard(mine)
        for key in mine:
            self._namespace_of.pop(key, None)
        if removed:
            self._unreadable(removed)
        self.directory.admission.clear()
        self.directory.take_events()
        return removed

    def _unreadable(self, keys: Sequence[ChunkKey] | set[ChunkKey]) -> None:
        """``keys`` stopped being readable: out of the index and the feed."""
        if self.index is not None:
            self.index.remove(keys)
        self.feed.removed(keys)

    # ------------------------------------------------------------------ announcements

    def announce(self, session: Session, entries: Sequence[tuple[ChunkKey, bytes]]) -> None:
        """Keep the records ``session``'s engine sent for chunks it stored, those
        readable now, under its namespace (see :mod:`.feed`)."""
        d = self.directory
        readable = [
            key for key, _ in entries
            if d.state_of(key) in (ChunkState.READY, ChunkState.PINNED)
            and self._namespace_of.get(key) == session.namespace
        ]  # fmt: skip
        self.feed.announce(session.namespace, entries, readable)

    def check(self) -> None:
        """Every invariant of the directory, and the sessions' bookings agree with it."""
        self.directory.check_integrity()
        pins = sum(sum(s.pins.values()) for s in self.sessions.values())
        if pins != self.directory.pinned_count:
            raise ContractViolation(
                f"sessions hold {pins} pins, the directory {self.directory.pinned_count}"
            )
        storing = sum(len(s.storing) for s in self.sessions.values())
        if storing != self.directory.storing_count:
            raise ContractViolation(
                f"sessions store {storing} chunks, the directory {self.directory.storing_count}"
            )
