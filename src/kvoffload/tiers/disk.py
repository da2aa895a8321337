"""The local-disk tier: one file per chunk and parallel rank.

Layout under ``root``::

    root/kvoffload-v1/<namespace digest hex>/<key hex[:2]>/<key hex>.r<rank>

Each file is a :mod:`kvoffload.core.chunk_format` header and the payload. A write
goes to a temporary name (``.tmp.<pid>.<n>``) and is renamed into place, so a torn
or partial write never appears under a chunk's name; every read is verified anyway
(a power cut can leave a renamed file whose data never reached the disk). Files
and directories are created owner-only (0600 / 0700).

With ``o_direct`` writes and reads bypass the page cache (``O_DIRECT``) through a
page-aligned bounce buffer; files are then zero-padded to 4 KiB (the header gives
the payload length, buffered reads accept the padding). Where the filesystem
refuses O_DIRECT, the store falls back to buffered I/O. Without it, reads go
straight into the caller's buffer.

Used from the worker's tier threads (reads, writes, deletes; each call touches one
file, calls on different files may run concurrently) and, at start-up, from the
scheduler half (:func:`scan`, :func:`sweep`). Errors: ``read_into`` raises
:class:`~kvoffload.core.chunk_format.IntegrityError` for a bad file and
``FileNotFoundError`` for a missing one; ``write`` raises ``OSError`` (disk full
included) after removing its temporary file.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import mmap
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from kvoffload.core.chunk_format import (
    HEADER_BYTES,
    IntegrityError,
    IntegrityReason,
    check_header,
    check_payload,
    encode_header,
    verify,
)
from kvoffload.core.keys import ChunkKey, shard_key

FORMAT_DIR = "kvoffload-v1"
ALIGN = 4096
_TMP = ".tmp."
_counter = itertools.count()


def namespace_dir(root: Path, namespace_digest: bytes) -> Path:
    return Path(root) / FORMAT_DIR / namespace_digest.hex()


@dataclass(frozen=True)
class ChunkFile:
    key: ChunkKey
    rank: int
    path: Path
    mtime: float


class DiskStore:
    """Chunk files of one namespace and one rank under ``root``."""

    def __init__(
        self,
        root: Path,
        namespace_digest: bytes,
        rank: int,
        payload_bytes: int,
        *,
        o_direct: bool = False,
    ) -> None:
        self.dir = namespace_dir(root, namespace_digest)
        self.digest = namespace_digest
        self.rank = rank
        self.payload_bytes = payload_bytes
        self.o_direct = o_direct and hasattr(os, "O_DIRECT")
        self.file_bytes = _aligned(HEADER_BYTES + payload_bytes)
        _make_private_dirs(self.dir)
        self._made: set[Path] = set()  # fan-out directories known to exist
        self._buffers = threading.local()  # per-thread aligned O_DIRECT buffers

    def path(self, key: ChunkKey) -> Path:
        hexkey = key.hex()
        return self.dir / hexkey[:2] / f"{hexkey}.r{self.rank}"

    def write(self, key: ChunkKey, payload: memoryview) -> None:
        """Store ``payload`` as ``key``'s chunk file (replacing an older one)."""
        final = self.path(key)
        if final.parent not in self._made:
            _make_private_dirs(final.parent)
            self._made.add(final.parent)
        tmp = final.with_name(f"{final.name}{_TMP}{os.getpid()}.{next(_counter)}")
        header = encode_header(self.digest, shard_key(key, self.rank), payload)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
        try:
            if self.o_direct:
                buf = self._aligned_buffer()
                buf[:HEADER_BYTES] = header
                end = HEADER_BYTES + len(payload)
                buf[HEADER_BYTES:end] = payload
                buf[end:] = bytes(len(buf) - end)  # padding: zeros, never stale bytes
                fd = self._open_direct(tmp, flags, 0o600)
                try:
                    _write_all(fd, buf)
                finally:
                    os.close(fd)
            else:
                fd = os.open(tmp, flags, 0o600)
                try:
                    written = os.writev(fd, [header, payload])
                    if written != HEADER_BYTES + len(payload):
                        _write_all(fd, memoryview(header + bytes(payload))[written:])
                finally:
                    os.close(fd)
            os.replace(tmp, final)
        except BaseException:
            unlink_quietly(tmp)
            raise

    def read_into(self, key: ChunkKey, out: memoryview) -> None:
        """Read and verify ``key``'s chunk into ``out`` (``payload_bytes`` long)."""
        path = self.path(key)
        if self.o_direct:
            buf = self._aligned_buffer()
            fd = self._open_direct(path, os.O_RDONLY)
            try:
                size = _read_all(fd, buf)
            finally:
                os.close(fd)
            stored = buf[: min(size, HEADER_BYTES + self.payload_bytes)]
            out[:] = verify(stored, self.digest, shard_key(key, self.rank), self.payload_bytes)
            return
        with open(path, "rb", buffering=0) as f:
            header = f.read(HEADER_BYTES)
            expected = check_header(header, self.digest, shard_key(key, self.rank), len(out))
            got = f.readinto(out) or 0
            rest = len(f.read(ALIGN))
        if rest and HEADER_BYTES + got + rest != _aligned(HEADER_BYTES + len(out)):
            raise IntegrityError(IntegrityReason.SIZE, "longer than its header says")
        check_payload(out[:got], len(out), expected)

    def _aligned_buffer(self) -> memoryview:
        """This thread's page-aligned buffer of one file (O_DIRECT needs aligned
        memory); allocated once per thread and kept for the store's lifetime."""
        buf: memoryview | None = getattr(self._buffers, "view", None)
        if buf is None:
            buf = memoryview(mmap.mmap(-1, self.file_bytes))
            self._buffers.view = buf
        return buf

    def _open_direct(self, path: Path, flags: int, mode: int = 0o600) -> int:
        """Open with O_DIRECT; where the filesystem refuses it (tmpfs), switch this
        store to buffered I/O for good (files stay readable either way: buffered
        reads accept the 4 KiB padding)."""
        try:
            return os.open(path, flags | os.O_DIRECT, mode)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self.o_direct = False
            return os.open(path, flags, mode)

    def delete(self, key: ChunkKey) -> None:
        unlink_quietly(self.path(key))


def scan(root: Path, namespace_digest: bytes) -> Iterator[ChunkFile]:
    """Every complete-looking chunk file of a namespace (all ranks); temporary files
    are skipped. Contents are not verified here (reads verify)."""
    base = namespace_dir(root, namespace_digest)
    if not base.is_dir():
        return
    for sub in sorted(base.iterdir()):
        if not sub.is_dir():
            continue
        for entry in os.scandir(sub):
            name = entry.name
            if _TMP in name or ".r" not in name:
                continue
            hexkey, _, rank = name.partition(".r")
            try:
                key = ChunkKey(bytes.fromhex(hexkey))
                stat = entry.stat()
            except (ValueError, OSError):
                continue
            if len(key) == 16 and rank.isdigit():
                yield ChunkFile(key, int(rank), Path(entry.path), stat.st_mtime)


def sweep(root: Path, namespace_digest: bytes) -> int:
    """Remove temporary files left by an interrupted writer; return how many."""
    base = namespace_dir(root, namespace_digest)
    removed = 0
    if base.is_dir():
        for path in base.glob(f"*/*{_TMP}*"):
            unlink_quietly(path)
            removed += 1
    return removed


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def _make_private_dirs(path: Path) -> None:
    """Create ``path`` and any missing parent, each owner-only (0700); existing
    directories are left as they are."""
    missing: list[Path] = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        with contextlib.suppress(FileExistsError):
            directory.mkdir(mode=0o700)


def unlink_quietly(path: Path) -> None:
    """Remove ``path``; already gone is fine."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        n = os.write(fd, data)
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        data = data[n:]


def _read_all(fd: int, out: memoryview) -> int:
    total = 0
    while total < len(out):
        n = os.readv(fd, [out[total:]])
        if n <= 0:
            break
        total += n
    return total
