"""An engine's calls to its share's node process: each with a deadline, reconnection
and restarts that never block.

:class:`Link` makes the calls of one scheduler half. Every call is bounded by
``timeout_s`` (each send and each receive); a call that fails (timed out, refused,
connection lost) returns None, counted in ``stats``, and closes the connection (a
late reply would be read as the next call's). The next call made ``retry_s`` or
more later reconnects (:mod:`.connection`; the engine's ``users.lock`` hold refreshed
first); if nobody listens it starts a node process (:mod:`.launch`) and returns None
at once: the engine never waits for the share. :meth:`Link.wait_ready` (tests,
start-up) is the only call that waits. Its session is held open by a
:class:`~kvoffload.share.lease.Lease` besides.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from collections import Counter
from collections.abc import Callable

from kvoffload.core.config.own_options import default
from kvoffload.core.errors import ContractViolation, KvOffloadError
from kvoffload.core.private_files import open_checked
from kvoffload.share.backing import Backing
from kvoffload.share.connection import Welcome, connect, refresh_users
from kvoffload.share.launch import Spawned, spawn_server
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.paths import SharePaths
from kvoffload.share.protocol import ONE_WAY, FrameError, Op, Role, Status, frame, read_frame
from kvoffload.share.users import UsersHold

__all__ = ["CALL_TIMEOUT_S", "Link"]

CALL_TIMEOUT_S = default("host_share_timeout_ms") / 1000
"""A call's deadline unless given (``host_share_timeout_ms``, in seconds)."""


class Link:
    """The calls of one scheduler half to the share (see the module docstring).

    ``on_connected(welcome)`` runs (in the caller's thread) each time a connection
    opens, before the call that opened it is sent.
    """

    def __init__(
        self,
        paths: SharePaths,
        session: bytes,
        namespace: bytes,
        geometry: ShareGeometry | None,
        *,
        timeout_s: float = CALL_TIMEOUT_S,
        retry_s: float = 0.05,
        start_server: bool = True,
        on_connected: Callable[[Welcome], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        backing: Backing | None = None,
        users: UsersHold | None = None,
    ) -> None:
        self.paths = paths
        self.users = users  # refreshed before each connection (see .users)
        self.backing = backing  # a backed share's: the node process it starts serves it
        self.session = session
        self.namespace = namespace
        self.geometry = geometry
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.start_server = start_server
        self.on_connected = on_connected
        self.stats: Counter[str] = Counter()
        self.welcome: Welcome | None = None
        self.spawned: Spawned | None = None
        # What retries are timed by; replaceable (a test driver steps it in logical time).
        self.clock = clock
        self._sock: socket.socket | None = None
        self._moved = False  # set by the lease's thread: reconnect before the next call
        self._next_attempt = 0.0
        self._lock_fd = -1

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def server_alive(self) -> bool:
        """Whether a node process holds the share's server lock (two system calls on a
        descriptor kept open; the kernel drops a dead process's lock at once)."""
        if self._lock_fd < 0:
            try:
                self._lock_fd = open_checked(self.paths.server_lock, os.O_RDONLY, self.paths.policy)
            except (OSError, KvOffloadError):
                return False
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return True
        fcntl.flock(self._lock_fd, fcntl.LOCK_UN)
        return False

    def note_moved(self) -> None:
        """Another node process serves the share now (its lease found it; any thread):
        the next call closes the connection to the old one and connects anew, at once."""
        self._moved = True

    def _socket(self) -> socket.socket | None:
        if self._moved:
            self._moved = False
            if self._sock is not None:
                self._sock.close()
                self._sock = None
        return self._sock if self._sock is not None else self._connect()

    def call(self, op: Op, payload: bytes = b"") -> bytes | None:
        """The reply's payload, or None when the share did not answer in time (or is
        down); a VIOLATION reply raises :class:`ContractViolation`."""
        sock = self._socket()
        if sock is None:
            self.stats["unavailable"] += 1
            return None
        try:
            sock.sendall(frame(op, payload))
            status, reply = read_frame(sock)
        except TimeoutError:
            self.stats["timeouts"] += 1
            self.drop()
            return None
        except (OSError, FrameError):
            self.stats["lost"] += 1
            self.drop()
            return None
        if status == Status.VIOLATION:
            raise ContractViolation(reply.decode(errors="replace"))
        if status != Status.OK:
            self.stats["errors"] += 1
            return None
        return reply

    def send(self, op: Op, payload: bytes = b"") -> bool:
        """Send a one-way call (no reply: see :data:`~.protocol.ONE_WAY`); whether it
        was sent within ``timeout_s``."""
        sock = self._socket()
        if sock is None:
            self.stats["unavailable"] += 1
            return False
        try:
            sock.sendall(frame(op | ONE_WAY, payload))
        except TimeoutError:
            self.stats["timeouts"] += 1
            self.drop()
            return False
        except OSError:
            self.stats["lost"] += 1
            self.drop()
            return False
        return True

    def drop(self) -> None:
        """Close the connection; the next attempt is ``retry_s`` from now."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._next_attempt = self.clock() + self.retry_s

    def _connect(self) -> socket.socket | None:
        if self.clock() < self._next_attempt:
            return None
        if (
            self.spawned is not None
            and self.spawned.ready_fd >= 0
            and not self.spawned.wait_ready(0)
        ):
            return None  # the node process this engine started is still starting
        refresh_users(self.users)
        opened = connect(self.paths, self.session, Role.DIRECTORY, self.namespace, self.timeout_s)
        if opened is None:
            self._next_attempt = self.clock() + self.retry_s
            if self.start_server:
                self._start_server()
            return None
        self._forget_server_lock()  # the server lock file may be another one now
        self._sock, self.welcome = opened
        self.stats["connects"] += 1
        if self.on_connected is not None:
            self.on_connected(self.welcome)
        return self._sock

    def _start_server(self) -> None:
        """Start a node process unless one runs (never raises: a share whose files
        cannot be made, e.g. another user squats its directory, is an ``errors``
        count, and calls go on missing)."""
        try:
            spawned = spawn_server(self.paths, self.geometry, self.backing)
        except (OSError, KvOffloadError):
            self.stats["errors"] += 1
            return
        if spawned is not None:
            self.stats["server_starts"] += 1
            if self.spawned is not None:
                self.spawned.close()
            self.spawned = spawned

    def _forget_server_lock(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    def wait_ready(self, timeout_s: float) -> bool:
        """Connect now, waiting up to ``timeout_s`` for a node process this engine
        started to listen; whether connected. (Start-up and tests only.)"""
        if self._sock is not None:
            return True
        self._next_attempt = 0.0
        if self._connect() is not None:
            return True
        if self.spawned is not None and self.spawned.ready_fd >= 0:
            self.spawned.wait_ready(timeout_s)
        self._next_attempt = 0.0
        return self._connect() is not None

    def close(self) -> None:
        self.drop()
        self._forget_server_lock()
        if self.spawned is not None:
            self.spawned.close()
