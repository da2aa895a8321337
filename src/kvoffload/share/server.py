"""The node process: one per share, owning its directory; engines call it over a
Unix socket.

It is started by :func:`~.server_start.open_server` (:mod:`.server_start`).

Every connection it accepts is checked (``SO_PEERCRED``, :mod:`.peer`): a process
of another user (outside the share's group, with one) is closed at once, counted and
logged. Its own files are watched: at most once a second, and at each
``prepare_store``, it checks that its directory, socket and slab files are still the
ones it made (same inode); when one is gone or replaced (``kvoffload share remove``
of a stopped share cannot do that, but a ``rm -rf`` or systemd's ``RemoveIPC`` can)
it logs why and stops serving, so that engines converge on the node process of the
share's new files.

Its backing (``backing``, :mod:`.backing`) says where its slots are (see
:mod:`.server_start`) and whether it restores them: a restoring backing (the disk
tier's slabs), once the generation fence is open (checked in the serve loop every
``fence_poll_s`` while closed, and by any ``prepare_store``), before it books a slot
or answers a load, restores every complete chunk its files hold
(:attr:`ShareServer.recovery`; logged as ``recovered N chunks, M copies ignored``).
Until then lookups miss, loads are refused and stores answer ``no_room``.

It then serves until stopped (:meth:`ShareServer.stop`, SIGTERM/SIGINT) and stays up
when its last engine leaves: a restarted engine finds the share warm. A share in
shared memory starts with an empty directory, whatever the slabs hold (bytes are never trusted
without the index), and books no slot until older generations are fenced
(:mod:`.fence`).

The loop is single-threaded (:mod:`selectors`): in each round, connections that
closed are released first, then every complete request is served in arrival order.
A process killed before a client's request was sent is therefore always released
before that request is served. A client that stops reading its replies for
``send_timeout_s`` is disconnected.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvoffload.core.directory import Directory
from kvoffload.core.private_files import same_file
from kvoffload.share.backing import Backing, Recovered
from kvoffload.share.book import ShareBook
from kvoffload.share.dispatch import dispatch
from kvoffload.share.fence import GenerationFence
from kvoffload.share.index import IndexWriter
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.paths import SharePaths
from kvoffload.share.peer import credentials, trusted
from kvoffload.share.protocol import (
    HEADER,
    HELLO,
    MAX_FRAME,
    ONE_WAY,
    WELCOME,
    Op,
    Role,
    Status,
    frame,
)

OWN_CHECK_S = 1.0
"""How often, at most, a node process checks that its files are still its own."""


@dataclass
class _Conn:
    sock: socket.socket
    buffer: bytearray = field(default_factory=bytearray)
    session: bytes | None = None


class ShareServer:
    """A running node process (see the module docstring). Build with
    :func:`~.server_start.open_server`."""

    def __init__(
        self,
        paths: SharePaths,
        geometry: ShareGeometry,
        directory: Directory,
        lock_fd: int,
        listener: socket.socket,
        *,
        index: IndexWriter,
        backing: Backing,
        release_backing: Callable[[], None] | None = None,
    ) -> None:
        self.paths = paths
        self.geometry = geometry
        self.backing = backing
        self._release_backing = release_backing
        self._fence = GenerationFence(paths, geometry.generation)
        fence_open = self._fence_then_recover if backing.restores else self._fence.open
        self.book = ShareBook(directory, fence_open, index)
        # A restoring backing's recovery, once done (None: not yet, or nothing to restore).
        self.recovery: Recovered | None = None
        self.fence_poll_s = 0.05  # how often a closed fence is looked at (backed share)
        self.send_timeout_s = 0.1
        self._lock_fd = lock_fd
        self._listener = listener
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ, None)
        self._conns: dict[int, _Conn] = {}
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._running = True
        self.refused = 0  # connections of untrusted processes, closed at once
        self._own = _own_files(paths, backing.owned_files(paths, geometry))
        self._owned_at = time.monotonic()
        self.gone: str | None = None  # why it stopped serving: its files are not its own

    def stop(self) -> None:
        """Make :meth:`serve_forever` return (safe from a signal handler or thread)."""
        self._running = False
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    @property
    def recovering(self) -> bool:
        """A restoring share that has not recovered its chunks yet (its fence is closed)."""
        return self.backing.restores and self.recovery is None

    def serve_forever(self) -> None:
        try:
            while self._running:
                timeout = min(self.fence_poll_s, OWN_CHECK_S) if self.recovering else OWN_CHECK_S
                self.serve_round(timeout)
                if time.monotonic() - self._owned_at >= OWN_CHECK_S:
                    self.check_own()
        finally:
            self.close()

    def check_own(self) -> bool:
        """Whether the share's directory, socket and slab files are still the ones this
        node process made; if not, log why and stop serving (the loop ends)."""
        self._owned_at = time.monotonic()
        if self.gone is not None:
            return False
        for path, st in self._own:
            if not same_file(path, st):
                self.gone = f"{path} was removed or replaced"
                _log(self.paths, f"stops serving: {self.gone}")
                self.stop()
                return False
        return True

    def serve_round(self, timeout: float | None) -> None:
        """One round: accept, release closed connections, recover a backed share's
        chunks if its fence just opened, serve complete requests."""
        ready: list[_Conn] = []
        for key, _ in self._selector.select(timeout):
            if key.data == "wake":
                os.read(self._wake_r, 64)
            elif key.fileobj is self._listener:
                self._accept()
            else:
                conn = self._conns[key.fd]
                if self._receive(conn):
                    ready.append(conn)
        if self.recovering:
            self._fence_then_recover()
        for conn in ready:
            self._serve_frames(conn)

    def _fence_then_recover(self) -> bool:
        """A restoring share's fence check: once no older generation has a transfer in
        flight, restore the complete chunks of its files (once); whether it is open."""
        if self.recovery is not None:
            return True
        if not self._fence.open():
            return False
        started = time.monotonic()
        entries, recovery = self.backing.recover(self.geometry)
        self.book.restore(entries, self.backing.namespace)
        self.recovery = recovery
        _log(
            self.paths,
            f"recovered {recovery.adopted} chunks, {recovery.ignored} copies ignored "
            f"({time.monotonic() - started:.3f} s, {self.geometry.num_slots} slots x "
            f"{self.geometry.ranks} ranks)",
        )
        return True

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except OSError:
            return
        try:
            peer = credentials(sock)
        except OSError:
            sock.close()
            return
        if not trusted(peer, self.paths.policy):
            sock.close()
            self.refused += 1
            if self.refused & (self.refused - 1) == 0:  # the 1st, 2nd, 4th, 8th, ...
                _log(
                    self.paths,
                    f"refused a connection of pid {peer.pid} (uid {peer.uid}, gid "
                    f"{peer.gid}): not trusted with this share ({self.refused} refused)",
                )
            return
        sock.settimeout(self.send_timeout_s)
        self._conns[sock.fileno()] = _Conn(sock)
        self._selector.register(sock, selectors.EVENT_READ, None)

    def _receive(self, conn: _Conn) -> bool:
        """Buffer what arrived; False (and the connection released) when it closed."""
        try:
            data = conn.sock.recv(1 << 20)
        except OSError:
            data = b""
        if not data:
            self._drop(conn)
            return False
        conn.buffer += data
        return True

    def _serve_frames(self, conn: _Conn) -> None:
        while len(conn.buffer) >= HEADER.size and conn.sock.fileno() in self._conns:
            length, op = HEADER.unpack_from(conn.buffer)
            if length > MAX_FRAME:
                self._drop(conn)
                return
            if len(conn.buffer) < HEADER.size + length:
                return
            payload = bytes(conn.buffer[HEADER.size : HEADER.size + length])
            del conn.buffer[: HEADER.size + length]
            status, reply = self._answer(conn, op & ~ONE_WAY, payload)
            if conn.session is None and status is not Status.OK:
                self._drop(conn)
                return
            if op & ONE_WAY:
                continue  # the caller does not wait for an answer
            try:
                conn.sock.sendall(frame(status, reply))
            except OSError:
                self._drop(conn)
                return

    def _answer(self, conn: _Conn, op: int, payload: bytes) -> tuple[Status, bytes]:
        if conn.session is None:
            if op != Op.HELLO or len(payload) < HELLO.size:
                return Status.ERROR, b"the first call must be HELLO"
            sid, role, ns_len = HELLO.unpack_from(payload)
            namespace = payload[HELLO.size : HELLO.size + ns_len]
            fresh = self.book.open_session(sid, namespace if role == Role.DIRECTORY else None)
            conn.session = sid
            g = self.geometry
            welcome = WELCOME.pack(
                g.generation, os.getpid(), g.num_slots, g.slot_bytes, g.ranks, fresh, g.slab_id
            )
            return Status.OK, welcome
        if op == Op.PREPARE_STORE and not self.check_own():
            return Status.ERROR, f"the share's files are gone: {self.gone}".encode()
        session = self.book.sessions[conn.session]
        return dispatch(self.book, session, op, payload)

    def _drop(self, conn: _Conn) -> None:
        fd = conn.sock.fileno()
        if self._conns.pop(fd, None) is None:
            return
        self._selector.unregister(conn.sock)
        conn.sock.close()
        if conn.session is not None:
            self.book.close_session(conn.session)

    def close(self) -> None:
        """Close every connection and the socket; the slabs and meta file stay."""
        for conn in list(self._conns.values()):
            self._drop(conn)
        self._selector.close()
        self._listener.close()
        if same_file(self.paths.socket, self._own[1][1]):  # never another's socket
            self.paths.socket.unlink(missing_ok=True)
        os.close(self._wake_r)
        os.close(self._wake_w)
        os.close(self._lock_fd)
        if self._release_backing is not None:
            self._release_backing()
            self._release_backing = None


def _log(paths: SharePaths, message: str) -> None:
    """One line for the share's log (a node process started by an engine writes its
    standard error there)."""
    print(f"kvoffload share {paths.name}: {message}", file=sys.stderr, flush=True)


def _own_files(paths: SharePaths, slots: list[Path]) -> list[tuple[Path, os.stat_result]]:
    """The files a node process checks are still its own: its directory, its socket
    and its backing's slot files in its directory, with their stats now."""
    return [(path, os.lstat(path)) for path in [paths.dir, paths.socket, *slots]]
