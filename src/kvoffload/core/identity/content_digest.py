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
with ``O_NOFOLLOW`` and checked. Processes computing the same file at once (the
scheduler half and the workers of one engine) serialise on a lock file per entry, so
each file is read once per node: the first process reads it, the others find its
entry.

A cache folder that cannot be used (a read-only home in a container, another owner)
is named once per process by a WARNING with the reason and the fix (set
``KVOFFLOAD_CACHE_DIR`` to a writable folder of this user's), and the digests are
remembered instead in a private folder of the temporary directory,
``$TMPDIR/kvoffload-digests-u<UID>`` (0700, checked the same way, in a temporary
directory whose other users cannot rename it away: :func:`.private_files.check_root`),
so the processes of an engine still read each file once. Where that cannot be used
either, each process reads every file once per start, and the warning says so. Within
one process, :meth:`DigestCache.default` is one shared object that also remembers
every digest it computed or read (under the same stat signature), so a second call (the
scheduler half and a worker in one process, a second derivation) reads nothing.
Remembered digests are never wrong: a file whose signature changed is read again.

Pure Python over ``os`` and ``xxhash``; never raises for an unreadable file: its
digest names the error, so both halves of the connector still agree.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash

from kvoffload.core.errors import ConfigError
from kvoffload.core.private_files import (
    FilePolicy,
    check_root,
    make_private_dir,
    open_or_create,
    read_checked,
    replace_atomically,
)

READ_BYTES = 16 << 20
"""Bytes read at a time."""

MAX_THREADS = 8
MAX_REMEMBERED = 4096
"""Digests a :class:`DigestCache` keeps in memory (all are forgotten past it)."""
_VERSION = 1
OPTION = "KVOFFLOAD_CACHE_DIR"
"""The environment variable that names the cache folder (module docstring)."""

logger = logging.getLogger("kvoffload")
_shared: dict[Path, DigestCache] = {}
_shared_lock = threading.Lock()


def cache_dir() -> Path:
    """Where the digests are remembered (module docstring)."""
    explicit = os.environ.get(OPTION)
    if explicit:
        return Path(explicit) / "digests"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvoffload" / "digests"


def fallback_dir() -> Path:
    """Where the digests are remembered when :func:`cache_dir` cannot be used: a folder
    of this user's in the temporary directory (module docstring)."""
    return Path(tempfile.gettempdir()) / f"kvoffload-digests-u{os.geteuid()}"


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
    """The remembered digests (module docstring): in the folder ``root`` when it can be
    used (``root`` None, or a folder that cannot be used: in memory only, and
    :attr:`problem` says why), and in memory. ``shared_parent``: ``root``'s parent is
    a folder other users write too (the temporary directory; see :func:`_private_dir`).
    Thread-safe."""

    def __init__(self, root: Path | None, *, shared_parent: bool = False) -> None:
        self._policy = FilePolicy("digest cache", key=OPTION)
        self.problem = (
            None if root is None else _private_dir(root, self._policy, shared_parent=shared_parent)
        )
        self.root = root if root is not None and self.problem is None else None
        self._known: dict[tuple[str, tuple[int, ...]], str] = {}
        self._lock = threading.Lock()

    @classmethod
    def default(cls) -> DigestCache:
        """This process's cache for :func:`cache_dir` (one object per folder, shared by
        every caller), or, when that folder cannot be used, for :func:`fallback_dir`,
        with one WARNING naming the folder, the reason and the fix (module
        docstring)."""
        wanted = cache_dir()
        with _shared_lock:
            cache = _shared.get(wanted)
            if cache is None:
                cache = _shared[wanted] = cls._open_default(wanted)
        return cache

    @classmethod
    def _open_default(cls, wanted: Path) -> DigestCache:
        cache = cls(wanted)
        if cache.problem is None:
            return cache
        fallback_root = fallback_dir()
        fallback = cls(fallback_root, shared_parent=True)
        if fallback.problem is None:
            instead = (
                f"the digests are remembered in {fallback_root} instead, until the "
                "temporary directory is cleared"
            )
        else:
            instead = (
                f"nor can {fallback_root} ({fallback.problem}): every process of the engine "
                "reads every weight file in full at every start"
            )
        logger.warning(
            "kvoffload: cannot use the weights digest cache folder %s (%s); %s. Fix: set "
            "%s (digests go in its digests/) or XDG_CACHE_HOME (in its kvoffload/digests/) "
            "to a writable folder of this user's",
            wanted,
            cache.problem,
            instead,
            OPTION,
        )
        return fallback

    def digest(self, path: Path) -> str:
        """``path``'s content digest, from memory or the folder when its signature still
        holds; ``"unreadable:<error>"`` for a file that cannot be read (never
        remembered)."""
        try:
            before = os.stat(path)
        except OSError as exc:
            return f"unreadable:{type(exc).__name__}"
        real = os.path.realpath(path)
        key = (real, tuple(signature(before)))
        with self._lock:
            known = self._known.get(key)
        if known is not None:
            return known
        digest = self._from_folder(path, real, before)
        if not digest.startswith(("unreadable:", "changing")):
            with self._lock:
                if len(self._known) >= MAX_REMEMBERED:
                    self._known.clear()
                self._known[key] = digest
        return digest

    def _from_folder(self, path: Path, real: str, before: os.stat_result) -> str:
        if self.root is None:
            return _digest_now(path, before)
        name = hashlib.blake2b(os.fsencode(real), digest_size=16).hexdigest()
        entry = self.root / f"{name}.json"
        remembered = _read(entry, self._policy, before)
        if remembered is not None:
            return remembered
        with _locked(entry.with_suffix(".lock"), self._policy):
            remembered = _read(entry, self._policy, before)  # another process just did it?
            if remembered is not None:
                return remembered
            digest = _digest_now(path, before)
            if not digest.startswith(("unreadable:", "changing")):
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


def _private_dir(root: Path, policy: FilePolicy, *, shared_parent: bool = False) -> str | None:
    """Create ``root`` (0700, with its parents) if needed; None when it is a directory
    of this user's that no one else can write, else why not. ``shared_parent``: the
    parent is one other users write too (the temporary directory): it must pass
    :func:`check_root`, and ``root`` must be exactly 0700."""
    try:
        if shared_parent:
            check_root(root.parent, policy)
            make_private_dir(root, policy)
            return None
        os.makedirs(root.parent, mode=0o700, exist_ok=True)
        make_private_dir(root, policy, others_may_read=True)
    except ConfigError as exc:
        return str(exc).removeprefix(f"kvoffload config '{policy.key}': ")
    except OSError as exc:
        return f"{exc.strerror or type(exc).__name__}: {exc.filename or root}"
    return None
