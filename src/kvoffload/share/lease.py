"""A connection that makes no calls (:class:`Lease`): it keeps an engine's session
open at the share's node process while its process lives (the node process releases
a session's bookings when its last connection closes), and notices a node process's
death (``on_lost``) without any call. It reconnects every ``retry_s`` from a daemon
thread, refreshing the engine's ``users.lock`` hold first (:mod:`.users`). Every
engine worker holds one (see :mod:`.opening`), as does a
:class:`~kvoffload.share.client.ShareDirectory` itself."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

from kvoffload.share.connection import Welcome, connect, refresh_users
from kvoffload.share.paths import SharePaths
from kvoffload.share.protocol import Role
from kvoffload.share.users import UsersHold


class Lease:
    """Holds session ``session`` open from a daemon thread (see the module docstring).

    ``on_lost(welcome)`` runs in that thread when a connection to the node process
    that sent ``welcome`` closes; ``on_found(welcome)`` when a connection to one opens
    (it may be another than the one its engine's calls are attached to: after the
    share's directory was deleted, a new node process serves the share while the old
    one may linger, or be killed before this lease ever reached it). :meth:`close`
    ends the lease (and its thread).
    """

    def __init__(
        self,
        paths: SharePaths,
        session: bytes,
        *,
        retry_s: float = 0.05,
        on_lost: Callable[[Welcome], None] | None = None,
        on_found: Callable[[Welcome], None] | None = None,
        users: UsersHold | None = None,
    ) -> None:
        self._paths = paths
        self._session = session
        self._retry_s = retry_s
        self._on_lost = on_lost
        self._on_found = on_found
        self._users = users
        self.on_close: list[Callable[[], None]] = []  # run by close(), once
        self._closed = threading.Event()
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self.connected = threading.Event()
        # The node process it is connected to: set once connected, cleared only after
        # ``on_lost`` returned (so a reader that sees another one knows it was told).
        self.welcome: Welcome | None = None
        self._thread = threading.Thread(target=self._run, name="kvoffload-share-lease", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed.is_set():
            refresh_users(self._users)
            opened = connect(self._paths, self._session, Role.LEASE, b"", 1.0)
            if opened is None:
                self._closed.wait(self._retry_s)
                continue
            sock, welcome = opened
            with self._lock:
                if self._closed.is_set():
                    sock.close()
                    return
                self._sock = sock
            self.welcome = welcome
            if self._on_found is not None:
                self._on_found(welcome)
            self.connected.set()
            sock.settimeout(None)
            try:
                while sock.recv(64):
                    pass  # the node process never writes to a lease
            except OSError:
                pass
            self.connected.clear()
            with self._lock:
                self._sock = None
            sock.close()
            if self._on_lost is not None and not self._closed.is_set():
                self._on_lost(welcome)
            self.welcome = None

    def close(self) -> None:
        """End the lease, then run :attr:`on_close` (what its opener attached to it)."""
        self._closed.set()
        with self._lock:
            if self._sock is not None:
                self._sock.shutdown(socket.SHUT_RDWR)
        self._thread.join()
        for release in self.on_close:
            release()
        self.on_close.clear()
