"""One engine per disk tier namespace: an exclusive lock on the namespace directory.

Two engines configured with one ``disk_path`` for the same model (data-parallel
replicas, two servers on one node) would write the same slab files, each with its own
directory of which slot holds what: they would overwrite each other's chunks and clear
each other's valid copies as corrupt. So the engine's scheduler half (one per engine,
the one process that exists before the engine's workers write) holds
``<namespace dir>/lock`` (:class:`DiskLock`) with ``flock(LOCK_EX | LOCK_NB)`` from the
moment it opens the disk tier until it shuts down; a second engine is refused at start
with one :class:`~kvoffload.core.errors.ConfigError` naming ``disk_path`` and the
holder.

- The lock belongs to one open file description: two acquisitions conflict even in one
  process (two in-process engines), and the kernel drops it when the holder's process
  ends however it ends, so a crashed engine never blocks a restart. The lock file it
  leaves behind is harmless and never deleted (deleting it would let two openers lock
  two different files).
- The file records the holder (pid, host, start time: one JSON line) for the refusal
  message only. It is written after the lock is taken: a refused engine may find it
  empty or still naming an earlier holder; the message then says what it found.
- Engines of different models use different namespace directories and never conflict.
- The engine's workers open their slabs before its scheduler half exists (vLLM builds
  the workers' connectors first). :func:`check_workers_engine` lets a worker refuse a
  namespace another engine holds, without taking the lock: it tries a shared lock,
  which the engine's own workers never conflict on, and accepts a holder that is its
  own process or its parent on this host (its own engine's scheduler half, in process
  or as the engine core that started it; no other topology re-opens a slab).
- A disk tier shared by every engine of a node (``host_share`` set with ``disk_path``)
  is owned by that share's node process (:mod:`kvoffload.tiers.disk_backing`): it holds
  this lock for its whole life, recording itself as the holder with the share's name
  (:attr:`Holder.share`), so a private engine and a disk share never use one namespace
  at once; the workers of an engine of that share accept it as holder
  (:func:`check_workers_engine` with ``share``). The node process may die while the
  share's engines still have transfers in flight into the slabs (its successor is
  fenced until they end): so every process of such an engine (scheduler half and
  workers) also holds ``<namespace dir>/users`` shared (:class:`ShareEngineHold`) for
  its life, and a private engine's :meth:`DiskLock.acquire` is refused while anyone
  does.
- Readers (``kvoffload inspect``) take no lock and skip the lock file.
- On NFS, Linux emulates ``flock`` with byte-range locks (NFSv4): the lock also holds
  between nodes that share the directory.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from kvoffload.core.errors import ConfigError
from kvoffload.core.private_files import open_checked, open_or_create
from kvoffload.tiers.disk import namespace_dir
from kvoffload.tiers.disk_files import disk_policy, private_namespace_dir

LOCK_NAME = "lock"
"""The lock file's name in a namespace directory (``kvoffload.tiers.disk``)."""
USERS_NAME = "users"
"""The file a disk share's engines hold shared (:class:`ShareEngineHold`)."""

SHARE_HINT = "set disk_share: node (or a host_share) on every engine to share one disk tier"
"""How a refused engine shares a disk tier (decision 0017), in every refusal."""

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_HOLDER_BYTES = 512  # a holder record is one short JSON line


@dataclass(frozen=True)
class Holder:
    """Who holds a namespace's lock, as the holder recorded it."""

    pid: int
    host: str
    since: str  # UTC, ISO 8601, seconds
    share: str | None = None  # the disk share whose node process holds it; None: an engine

    def describe(self) -> str:
        return f"pid {self.pid} on host {self.host} since {self.since}"

    def encode(self) -> bytes:
        record: dict[str, object] = {"pid": self.pid, "host": self.host, "since": self.since}
        if self.share is not None:
            record["share"] = self.share
        return (json.dumps(record) + "\n").encode()

    @classmethod
    def decode(cls, raw: bytes) -> Holder | None:
        """The record in ``raw``; None when it is empty or not a holder record."""
        try:
            doc = json.loads(raw.decode())
            share = doc.get("share")
            holder = cls(
                int(doc["pid"]),
                str(doc["host"]),
                str(doc["since"]),
                None if share is None else str(share),
            )
        except (ValueError, KeyError, TypeError):
            return None
        return holder

    @classmethod
    def this_process(cls, share: str | None = None) -> Holder:
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        return cls(os.getpid(), socket.gethostname(), since, share)


def lock_path(root: Path, namespace_digest: bytes) -> Path:
    return namespace_dir(root, namespace_digest) / LOCK_NAME


class _FileHold:
    """An open file holding a ``flock``: closing its only descriptor drops the lock
    (the file stays). :meth:`release` is idempotent and never raises; the process's
    end releases it too."""

    def __init__(self, fd: int) -> None:
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def release(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


class DiskLock(_FileHold):
    """One engine's hold on one namespace directory of a disk tier. Owned by the
    scheduler half that acquired it; :meth:`release` (idempotent) ends the hold, and so
    does the process's end."""

    def __init__(self, path: Path, fd: int, holder: Holder) -> None:
        super().__init__(fd)
        self.path = path
        self.holder = holder

    @classmethod
    def acquire(cls, root: Path, namespace_digest: bytes, *, share: str | None = None) -> DiskLock:
        """Take the namespace directory's lock (creating the directories owner-only and
        the lock file 0600 if missing) and record this process as its holder (the node
        process of disk share ``share`` when given, else an engine).

        Raises :class:`ConfigError` naming ``disk_path`` when another engine holds it
        (nothing is changed then); ``OSError`` when the file cannot be opened.
        """
        path = lock_path(root, namespace_digest)
        private_namespace_dir(root, namespace_digest)
        fd = open_or_create(path, os.O_RDWR, disk_policy(root))
        try:
            if not try_flock(fd, fcntl.LOCK_EX):
                raise in_use(root, read_holder(fd))
            if share is None and _share_engines_live(path.parent):
                raise ConfigError(
                    "disk_path",
                    f"{root} is in use by the engines of a disk share (its node process is "
                    f"restarting); {SHARE_HINT}",
                )
            holder = Holder.this_process(share)
            os.ftruncate(fd, 0)
            os.pwrite(fd, holder.encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd, holder)


class ShareEngineHold(_FileHold):
    """A process of a disk share's engine: its shared hold on the namespace's
    ``users`` file, from before it connects to the share until :meth:`release` (or its
    end), so that no private engine takes the namespace while it may still write."""

    @classmethod
    def acquire(cls, root: Path, namespace_digest: bytes) -> ShareEngineHold:
        """Take the hold (creating the directories and the file owner-only if missing);
        waits only while a private engine checks the file (one system call)."""
        path = private_namespace_dir(root, namespace_digest) / USERS_NAME
        fd = open_or_create(path, os.O_RDWR, disk_policy(root))
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd)


def _share_engines_live(directory: Path) -> bool:
    """Whether some process holds ``directory/users`` (a disk share's engine)."""
    try:
        fd = open_checked(directory / USERS_NAME, os.O_RDONLY, disk_policy(directory))
    except FileNotFoundError:
        return False
    try:
        if try_flock(fd, fcntl.LOCK_EX):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        return True
    finally:
        os.close(fd)


def check_workers_engine(root: Path, namespace_digest: bytes, *, share: str | None = None) -> None:
    """A worker's check before it opens its slab: raises :class:`ConfigError` naming
    ``disk_path`` when an engine other than the worker's own holds the namespace's
    lock. The worker of an engine of disk share ``share`` accepts that share's node
    process as holder (and nothing else); a private engine's worker refuses any share.
    Takes no lock that outlives the call and creates nothing."""
    try:
        fd = open_checked(lock_path(root, namespace_digest), os.O_RDONLY, disk_policy(root))
    except FileNotFoundError:
        return  # never held
    try:
        if try_flock(fd, fcntl.LOCK_SH):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return
        holder = read_holder(fd)
        if holder is None:
            raise in_use(root, holder)
        if share is not None:
            if holder.share != share:
                raise in_use(root, holder)
            return  # the node process of this engine's disk share
        if holder.share is not None or not _is_own_engine(holder):
            raise in_use(root, holder)
    finally:
        os.close(fd)


def try_flock(fd: int, mode: int) -> bool:
    """Take ``mode`` (``LOCK_EX`` or ``LOCK_SH``) on ``fd`` without waiting: False when
    another open file description holds a conflicting lock; other errors raise."""
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        return False
    return True


def read_holder(fd: int) -> Holder | None:
    """The holder recorded in an open lock file (None: not recorded yet, or unreadable)."""
    try:
        return Holder.decode(os.pread(fd, _HOLDER_BYTES, 0))
    except OSError:
        return None


def holder_of(root: Path, namespace_digest: bytes) -> Holder | None:
    """Who holds the namespace's lock now, as recorded; None when nobody holds it (or
    the holder is not recorded yet). Takes no lock that outlives the call."""
    try:
        fd = open_checked(lock_path(root, namespace_digest), os.O_RDONLY, disk_policy(root))
    except (FileNotFoundError, NotADirectoryError):
        return None  # never held (or no such directory: whoever opens it finds out)
    try:
        if try_flock(fd, fcntl.LOCK_SH):
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        return read_holder(fd)
    finally:
        os.close(fd)


def in_use(root: Path, holder: Holder | None) -> ConfigError:
    """The one-line refusal of a second engine (or disk share) on ``root``."""
    if holder is not None and holder.share is not None:
        return ConfigError(
            "disk_path",
            f"{root} is in use by the node process of disk share {holder.share} "
            f"({holder.describe()}); {SHARE_HINT}",
        )
    who = holder.describe() if holder is not None else "holder not recorded"
    return ConfigError(
        "disk_path",
        f"{root} is in use by another engine ({who}); give each engine its own disk_path, "
        f"or {SHARE_HINT}",
    )


def _is_own_engine(holder: Holder) -> bool:
    return holder.host == socket.gethostname() and holder.pid in (os.getpid(), os.getppid())
