"""Digests of whole files' content, remembered per file until the file changes.

A model's weight files and a LoRA adapter's files are identified by their content
(decision 0019): an in-place rewrite of any byte changes the digest, and two copies of
the same files on two machines (engines sharing a Redis tier) agree. Reading every
byte costs time (xxh3-128 reads 5-6 GB/s per core from the page cache; files are
hashed on several threads at once, see :func:`digest_files`), so each file's digest is
remembered in a small per-user cache, keyed by its path and stat signature (device,
inode, size, modification and change times in nanoseconds): the kernel sets the
change time on every write, rename or metadata change, and no user can set it back,
so any change of the file's bytes is a new signature and the file is read again. A
restart on the same node reads nothing.

The cache is a directory (``$KVOFFLOAD_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvoffload``,
else ``~/.cache/kvoffload``, then ``digests/``) of one JSON file per path, made and
read as :mod:`.private_files` says: the directory created 0700 and checked to be the
user's own, entries written to a new file (``O_EXCL``) and renamed into place, read
with ``O_NOFOLLOW`` and checked. Processes computing
the same file at once (the workers of one engine start together) serialise on a lock
file per entry, so each file is read once. A cache that cannot be used (read-only
home, another owner) is skipped: digests are computed each time, never wrong.

Pure Python over ``os`` and ``xxhash``; never raises for an unreadable file: its
digest names the error, so both halves of the connector still agree.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from kvoffload.core.errors import ConfigError
from kvoffload.core.private_files import (
    FilePolicy,
    make_private_dir,
    open_or_create,
    read_checked,
    replace_atomically,
)

READ_BYTES = 16 << 20
"""Bytes read at a time."""

MAX_THREADS = 8
_VERSION = 1


def cache_dir() -> Path:
    """Where the digests are remembered (module docstring)."""
    explicit = os.environ.get("KVOFFLOAD_CACHE_DIR")
    if explicit:
        return Path(explicit) / "digests"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvoffload" / "digests"


def signature(st: os.stat_result) -> list[int]:
    """What must stay equal for a remembered digest to hold."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def hash_file(path: Path) -> str:
    """The xxh3-128 digest of ``path``'s bytes (hex), read in full."""
    h = xxhash.xxh3_128()
    buffer = bytearray(READ_BYTES)
    view = memoryview(buffer)
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        while True:
            n = os.readv(fd, [buffer])
            if n == 0:
                break
            h.update(view[:n])
    finally:
        os.close(fd)
    return h.hexdigest()


class DigestCache:
    """The remembered digests (module docstring). ``root`` None: remember nothing."""

    def __init__(self, root: Path | None) -> None:
        self._policy = FilePolicy("digest cache", key="KVOFFLOAD_CACHE_DIR")
        self.root = root if root is not None and _private_dir(root, self._policy) else None

    @classmethod
    def default(cls) -> DigestCache:
        return cls(cache_dir())

    def digest(self, path: Path) -> str:
        """``path``'s content digest, from the cache when its signature still holds;
        ``"unreadable:<error>"`` for a file that cannot be read."""
        try:
            before = os.stat(path)
        except OSError as exc:
            return f"unreadable:{type(exc).__name__}"
        if self.root is None:
            return _digest_now(path, before)
        name = hashlib.blake2b(os.fsencode(os.path.realpath(path)), digest_size=16).hexdigest()
        entry = self.root / f"{name}.json"
        remembered = _read(entry, self._policy, before)
        if remembered is not None:
            return remembered
        with _locked(entry.with_suffix(".lock"), self._policy):
            remembered = _read(entry, self._policy, before)  # another process just did it?
            if remembered is not None:
                return remembered
            digest = _digest_now(path, before)
            if not digest.startswith("unreadable:"):
                _write(entry, self._policy, before, digest)
            return digest


def digest_files(paths: Sequence[Path], cache: DigestCache | None = None) -> list[str]:
    """The content digest of each of ``paths``, in order, computed on up to
    :data:`MAX_THREADS` threads (xxh3 and reads release the GIL)."""
    cache = cache if cache is not None else DigestCache.default()
    if len(paths) <= 1:
        return [cache.digest(p) for p in paths]
    threads = max(1, min(MAX_THREADS, len(paths), (os.cpu_count() or 2) // 2 or 1))
    with ThreadPoolExecutor(threads, thread_name_prefix="kvoffload-digest") as pool:
        return list(pool.map(cache.digest, paths))


def _digest_now(path: Path, before: os.stat_result) -> str:
    try:
        digest = hash_file(path)
        after = os.stat(path)
    except OSError as exc:
        return f"unreadable:{type(exc).__name__}"
    if signature(after) != signature(before):
        return "changing"  # written while read: a digest that matches nothing
    return digest


def _read(entry: Path, policy: FilePolicy, st: os.stat_result) -> str | None:
    try:
        data = json.loads(read_checked(entry, policy, 4096))
    except (OSError, ValueError, ConfigError):
        return None
    if not isinstance(data, dict):
        return None
    if data.get("version") == _VERSION and data.get("signature") == signature(st):
        digest = data.get("digest")
        return digest if isinstance(digest, str) else None
    return None


def _write(entry: Path, policy: FilePolicy, st: os.stat_result, digest: str) -> None:
    content = json.dumps({"version": _VERSION, "signature": signature(st), "digest": digest})

    def write(fd: int) -> None:
        os.write(fd, content.encode())

    with contextlib.suppress(OSError, ConfigError):
        replace_atomically(entry, policy, write)


@contextlib.contextmanager
def _locked(path: Path, policy: FilePolicy) -> Iterator[None]:
    try:
        fd = open_or_create(path, os.O_RDWR, policy)
    except (OSError, ConfigError):
        yield  # no lock: at worst two processes read the same file
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _private_dir(root: Path, policy: FilePolicy) -> bool:
    """Create ``root`` (0700, with its parents) if needed; whether it is a directory
    of this user's that no one else can write."""
    try:
        os.makedirs(root.parent, mode=0o700, exist_ok=True)
        make_private_dir(root, policy, others_may_read=True)
    except (OSError, ConfigError):
        return False
    return True
