"""``kvoffload share stop NAME`` and ``kvoffload share remove NAME``: what they verify
before they signal or delete anything (decision 0018).

**stop** signals only a process it verified is that share's node process, and waits
(bounded) until it exited, so ``stop && remove`` works:

1. the share's server lock is held (else the share is not running: exit 0, says so),
   and its file names a pid;
2. that pid is the one at the other end of the share's socket (``SO_PEERCRED``);
3. a ``pidfd`` of it is taken, *then* the process behind the socket answers a HELLO
   naming that pid: it was alive after the pidfd was taken, so the pidfd is its own
   (a pid recycled meanwhile cannot be signalled);
4. ``/proc/PID`` belongs to this user;
5. SIGTERM goes through the pidfd (``pidfd_send_signal``), and the pidfd is polled
   until the process exited.

Anything that does not verify is an exit status of 1 and one line saying why;
nothing is signalled.

**remove** deletes exactly that share's directory, ``ROOT/kvoffload-u<UID>/NAME/``:
the files whose names it knows (:func:`~.paths.known_name`), through a descriptor of
the checked directory (no path is followed); a file it does not know is left (and
named), and so is the directory then. It refuses (exit 1, one line) while the share's
node process runs (its server lock is held) or any engine is attached (its
``users.lock`` is held: :mod:`.users`); both locks are held while it deletes, so no
node process starts and no engine attaches meanwhile.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import select
import signal
import socket
import stat
import struct
from pathlib import Path

from kvoffload.core.errors import KvOffloadError
from kvoffload.core.private_files import open_checked, read_checked
from kvoffload.share.launch import server_alive
from kvoffload.share.paths import SharePaths, known_name
from kvoffload.share.peer import credentials
from kvoffload.share.protocol import HELLO, WELCOME, FrameError, Op, Role, Status, frame, read_frame

STOP_WAIT_S = 10.0
"""How long ``stop`` waits for the node process to exit."""


def recorded_pid(paths: SharePaths) -> int | None:
    """The pid the share's server lock file records (None: none, or untrusted)."""
    try:
        data = read_checked(paths.server_lock, paths.policy, 4)
    except (OSError, KvOffloadError):
        return None
    return struct.unpack("<I", data)[0] if len(data) == 4 else None


def stop_share(paths: SharePaths, wait_s: float = STOP_WAIT_S) -> tuple[int, str]:
    """Stop the share's node process (see the module docstring): ``(exit status,
    the line to print)``."""
    name = paths.name
    if not server_alive(paths):
        return 0, f"share {name!r} is not running (in {paths.dir})"
    pid = recorded_pid(paths)
    if pid is None:
        return 1, f"share {name!r}: its server lock names no pid: nothing signalled"
    refused = f"share {name!r}: nothing signalled: "
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError as exc:
        return 1, refused + f"no socket ({exc.strerror})"
    with sock:
        sock.settimeout(2.0)
        try:
            sock.connect(str(paths.socket))
            peer = credentials(sock)
        except OSError as exc:
            return 1, refused + (
                f"its node process (pid {pid}, says its lock file) does not answer on "
                f"{paths.socket} ({exc.strerror}); if it hangs, check that pid {pid} is "
                "kvoffload's node process and kill it"
            )
        if peer.pid != pid:
            return 1, refused + f"its lock file names pid {pid}, its socket pid {peer.pid}"
        try:
            pidfd = os.pidfd_open(pid)
        except OSError as exc:
            return 1, refused + f"pid {pid}: {exc.strerror}"
        try:
            why = _verify(paths, sock, pid)
            if why is not None:
                return 1, refused + why
            sock.close()
            signal.pidfd_send_signal(pidfd, signal.SIGTERM)
            if not select.select([pidfd], [], [], wait_s)[0]:
                return 1, f"share {name!r}: its node process (pid {pid}) was sent SIGTERM "
                f"and has not exited after {wait_s:.0f} s"
        except OSError as exc:
            return 1, refused + f"pid {pid}: {exc.strerror}"
        finally:
            os.close(pidfd)
    return 0, f"stopped share {name!r} (node process pid {pid})"


def _verify(paths: SharePaths, sock: socket.socket, pid: int) -> str | None:
    """After the pidfd was taken: the process behind the socket answers with ``pid``,
    ``/proc/PID`` is this user's, the server lock is still held; else why not."""
    try:
        sock.sendall(frame(Op.HELLO, HELLO.pack(bytes(16), Role.LEASE, 0)))
        status, payload = read_frame(sock)
    except (OSError, FrameError):
        return f"its node process (pid {pid}) did not answer"
    if status != Status.OK or len(payload) != WELCOME.size:
        return f"its node process (pid {pid}) did not welcome"
    if WELCOME.unpack(payload)[1] != pid:
        return f"the process on its socket says it is pid {WELCOME.unpack(payload)[1]}, not {pid}"
    try:
        owner = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return f"pid {pid} is gone"
    if owner != paths.uid:
        return f"pid {pid} belongs to uid {owner}, not to this user (uid {paths.uid})"
    if not server_alive(paths):
        return "its server lock is no longer held"
    return None


def remove_share(paths: SharePaths) -> tuple[int, str]:
    """Delete the share's directory (see the module docstring): ``(exit status, the
    line to print)``."""
    name, where = paths.name, paths.dir
    try:
        parent = _open_dir(paths, paths.user_dir)
    except FileNotFoundError:
        return 0, f"no share {name!r} in {paths.root}"
    except _Refused as refused:
        return 1, f"share {name!r}: {refused}: nothing removed"
    try:
        try:
            fd = _open_dir(paths, where, parent)
        except FileNotFoundError:
            return 0, f"no share {name!r} in {paths.root}"
        except _Refused as refused:
            return 1, f"share {name!r}: {refused}: nothing removed"
        try:
            return _remove_files(paths, fd, parent)
        finally:
            os.close(fd)
    finally:
        os.close(parent)


class _Refused(Exception):
    pass


def _open_dir(paths: SharePaths, path: Path, parent: int | None = None) -> int:
    """A descriptor of directory ``path`` (under ``parent``'s descriptor), checked
    as the share's policy says; :class:`_Refused` with why otherwise."""
    target = os.path.basename(path) if parent is not None else path
    try:
        fd = os.open(
            target, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent
        )
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _Refused(f"{path} is not a directory (or is a link)") from None
        raise
    st = os.fstat(fd)
    problem = paths.policy.problem(st)
    if problem is not None or not stat.S_ISDIR(st.st_mode):
        os.close(fd)
        raise _Refused(f"{path} {problem or 'is not a directory'}")
    return fd


def _remove_files(paths: SharePaths, fd: int, parent: int) -> tuple[int, str]:
    name = paths.name
    locks: list[int] = []
    try:
        for lock, busy in (
            (paths.server_lock, _node_runs(paths)),
            (paths.users_lock, f"engines are attached to it (their processes hold "
             f"{paths.users_lock}): stop them first"),
        ):  # fmt: skip
            held = _lock_exclusive(paths, lock)
            if held is None:
                return 1, f"share {name!r}: {busy}: nothing removed"
            if held >= 0:
                locks.append(held)
        unknown = []
        removed = 0
        for entry in sorted(os.listdir(fd)):
            if not known_name(entry):
                unknown.append(entry)
                continue
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry, dir_fd=fd)
                removed += 1
        if unknown:
            return 1, (
                f"share {name!r}: removed {removed} files; left {len(unknown)} it does not "
                f"know ({', '.join(unknown[:5])}), so {paths.dir} stays"
            )
        os.rmdir(name, dir_fd=parent)
        return 0, f"removed share {name!r} ({removed} files, {paths.dir})"
    finally:
        for lock_fd in locks:
            os.close(lock_fd)


def _node_runs(paths: SharePaths) -> str:
    pid = recorded_pid(paths)
    who = f" (pid {pid})" if pid is not None else ""
    return f"its node process runs{who}: `kvoffload share stop {paths.name}` first"


def _lock_exclusive(paths: SharePaths, path: Path) -> int | None:
    """An exclusive lock on lock file ``path``: its descriptor; -1 when there is no
    such file (nobody can hold it); None when someone holds it."""
    try:
        fd = open_checked(path, os.O_RDWR, paths.policy)
    except FileNotFoundError:
        return -1
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd
