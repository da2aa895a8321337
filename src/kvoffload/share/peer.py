"""Who is at the other end of a share's Unix socket (``SO_PEERCRED``), and whether the
share trusts them (decision 0018).

The kernel records a socket peer's pid, uid and gid when it connects (or, for the
listening end, when it listened); they cannot be forged by the peer. The node process
checks every connection it accepts (:func:`trusted`), an engine the node process it
connects to, and ``kvoffload share stop`` the process it is about to signal.
"""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

from kvoffload.core.private_files import FilePolicy

_UCRED = struct.Struct("3i")


@dataclass(frozen=True)
class Credentials:
    pid: int
    uid: int
    gid: int


def credentials(sock: socket.socket) -> Credentials:
    """The peer of a connected Unix socket, as the kernel recorded it."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return Credentials(*_UCRED.unpack(raw))


def supplementary_groups(pid: int) -> set[int]:
    """The supplementary groups of process ``pid`` (``/proc/PID/status``, ``Groups:``);
    empty when it cannot be read (the process is gone)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            for line in status:
                if line.startswith(b"Groups:"):
                    return {int(g) for g in line.split()[1:]}
    except (OSError, ValueError):
        pass
    return set()


def trusted(peer: Credentials, policy: FilePolicy) -> bool:
    """The share trusts ``peer``: the same user; with a group, also any member of it
    (its primary group, or a supplementary one)."""
    if peer.uid == policy.uid:
        return True
    if policy.group is None:
        return False
    return peer.gid == policy.group or policy.group in supplementary_groups(peer.pid)
