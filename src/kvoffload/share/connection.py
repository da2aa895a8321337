"""One connection to a share's node process: opened, its peer checked
(``SO_PEERCRED``, :mod:`.peer`), its HELLO answered with a :class:`Welcome`; and the
``users.lock`` hold every engine connection refreshes first (:mod:`.users`)."""

from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass

from kvoffload.core.errors import KvOffloadError
from kvoffload.share.paths import SharePaths
from kvoffload.share.peer import credentials, trusted
from kvoffload.share.protocol import HELLO, WELCOME, FrameError, Op, Role, Status, frame, read_frame
from kvoffload.share.users import UsersHold


@dataclass(frozen=True)
class Welcome:
    """What the node process said when a connection opened."""

    generation: int
    pid: int
    num_slots: int
    slot_bytes: int
    ranks: int
    fresh: bool  # the session is new to this node process (it holds no booking of it)
    slab_id: bytes = b""  # the share's slab files' id (see .meta)

    @property
    def identity(self) -> tuple[int, bytes]:
        """Which node process this is: its generation and its slab files' id (after
        the share's directory was deleted wholesale, generations count from 1 again
        under another slab id)."""
        return self.generation, self.slab_id


def connect(
    paths: SharePaths, session: bytes, role: Role, namespace: bytes, timeout_s: float
) -> tuple[socket.socket, Welcome] | None:
    """A connection with its HELLO answered, or None (nobody listens, no answer, or
    the process listening is not one the share trusts: ``SO_PEERCRED``)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(str(paths.socket))
        peer = credentials(sock)
        if not trusted(peer, paths.policy):
            raise FrameError(f"the socket's process (uid {peer.uid}) is not trusted")
        sock.sendall(frame(Op.HELLO, HELLO.pack(session, role, len(namespace)) + namespace))
        status, payload = read_frame(sock)
        if status != Status.OK or len(payload) != WELCOME.size:
            raise FrameError("refused")
    except (OSError, FrameError):
        sock.close()
        return None
    generation, pid, slots, slot_bytes, ranks, fresh, slab_id = WELCOME.unpack(payload)
    if pid != peer.pid:
        sock.close()
        return None
    welcome = Welcome(generation, pid, slots, slot_bytes, ranks, bool(fresh), slab_id)
    return sock, welcome


def refresh_users(users: UsersHold | None) -> None:
    """Hold the ``users.lock`` of the share's directory now, before connecting to its
    node process (never raises: a directory that cannot be made is found again by
    the connection, or by the node process's start)."""
    if users is not None:
        with contextlib.suppress(OSError, KvOffloadError):
            users.refresh()
