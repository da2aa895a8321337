"""The local-disk tier: one file per chunk and parallel rank.

Layout under ``root``::

    root/kvoffload-v1/<namespace digest hex>/<key hex[:2]>/<key hex>.r<rank>

Each file is one 4 KiB header block (a :mod:`kvoffload.core.chunk_format` header,
zero-padded) followed by the payload, zero-padded to a multiple of 4 KiB. A write
goes to a temporary name (``.tmp.<pid>.<n>``) and is renamed into place, so a torn
or partial write never appears under a chunk's name; every read is verified anyway
(a power cut can leave a renamed file whose data never reached the disk). Files
and directories are created owner-only (0600 / 0700).

With ``o_direct`` writes and reads bypass the page cache (``O_DIRECT``). The
layout keeps the payload page-aligned in the file, so a page-aligned caller buffer
(a host slab slot) is written and read in place, with no copy; other buffers go
through a per-thread bounce buffer. Where the filesystem refuses O_DIRECT, the
store falls back to buffered I/O (same layout). Buffered reads go straight into the
caller's buffer.

Used from the worker's tier threads (reads, writes, deletes; each call touches one
file, calls on different files may run concurrently) and, at start-up, from the
scheduler half (:func:`scan`, :func:`sweep`). Errors: ``read_into`` raises
:class:`~kvoffload.core.chunk_format.IntegrityError` for a bad file and
``FileNotFoundError`` for a missing one; ``write`` raises ``OSError`` (disk full
included) after removing its temporary file.
"""

from __future__ import annotations

import contextlib
import ctypes
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
)
from kvoffload.core.keys import ChunkKey, shard_key

FORMAT_DIR = "kvoffload-v1"
ALIGN = 4096
PAYLOAD_OFFSET = ALIGN  # the header block: header, zero-padded to one page
_ZERO_BLOCK = bytes(ALIGN)
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
        self.file_bytes = file_bytes(payload_bytes)
        self._pad = bytes(self.file_bytes - PAYLOAD_OFFSET - payload_bytes)
        _make_private_dirs(self.dir)
        self._made: set[Path] = set()  # fan-out directories known to exist
        self._buffers = threading.local()  # per-thread aligned buffers (O_DIRECT)

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
            fd = self._open_direct(tmp, flags) if self.o_direct else os.open(tmp, flags, 0o600)
            try:
                _write_all(fd, self._file_parts(header, payload, direct=self.o_direct))
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except BaseException:
            unlink_quietly(tmp)
            raise

    def read_into(self, key: ChunkKey, out: memoryview) -> None:
        """Read and verify ``key``'s chunk into ``out`` (``payload_bytes`` long)."""
        path = self.path(key)
        direct = self.o_direct
        fd = self._open_direct(path, os.O_RDONLY) if direct else os.open(path, os.O_RDONLY)
        try:
            head = self._head_block(clear=False)
            if not direct:  # one extra page catches a file longer than it should be
                got = _read_all(fd, [head, out, memoryview(bytearray(ALIGN))]) - PAYLOAD_OFFSET
            elif _is_aligned(out):  # straight into the caller's memory
                got = _read_all(fd, [head, out]) - PAYLOAD_OFFSET
            else:
                bounce = self._bounce()
                got = _read_all(fd, [head, bounce]) - PAYLOAD_OFFSET
                out[:] = bounce[: len(out)]
        finally:
            os.close(fd)
        expected = check_header(
            head[:HEADER_BYTES], self.digest, shard_key(key, self.rank), len(out)
        )
        if got > len(self._pad) + len(out):
            raise IntegrityError(IntegrityReason.SIZE, "longer than its header says")
        check_payload(out[: max(got, 0)], len(out), expected)

    def delete(self, key: ChunkKey) -> None:
        unlink_quietly(self.path(key))

    # ------------------------------------------------------------ internals

    def _file_parts(self, header: bytes, payload: memoryview, *, direct: bool) -> list[memoryview]:
        """The file as buffers to write: the header block, the payload, the padding.
        O_DIRECT needs page-aligned memory: the payload goes straight from the
        caller's buffer when it is aligned, else through this thread's bounce buffer."""
        head = self._head_block(clear=True)
        head[: len(header)] = header
        if not direct:
            return [head, payload, memoryview(self._pad)]
        if _is_aligned(payload) and not self._pad:
            return [head, payload]
        bounce = self._bounce()
        bounce[: len(payload)] = payload
        bounce[len(payload) :] = self._pad
        return [head, bounce]

    def _head_block(self, *, clear: bool) -> memoryview:
        head = self._thread_buffer("head", PAYLOAD_OFFSET)
        if clear:
            head[HEADER_BYTES:] = _ZERO_BLOCK[HEADER_BYTES:]
        return head

    def _bounce(self) -> memoryview:
        return self._thread_buffer("bounce", self.file_bytes - PAYLOAD_OFFSET)

    def _thread_buffer(self, name: str, size: int) -> memoryview:
        """This thread's page-aligned buffer ``name`` (allocated once per thread,
        kept for the store's lifetime: O_DIRECT needs aligned memory)."""
        buf: memoryview | None = getattr(self._buffers, name, None)
        if buf is None:
            buf = memoryview(mmap.mmap(-1, size))
            setattr(self._buffers, name, buf)
        return buf

    def _open_direct(self, path: Path, flags: int) -> int:
        """Open with O_DIRECT; where the filesystem refuses it (tmpfs), switch this
        store to buffered I/O for good (the file layout is the same either way)."""
        try:
            return os.open(path, flags | os.O_DIRECT, 0o600)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            self.o_direct = False
            return os.open(path, flags, 0o600)


def file_bytes(payload_bytes: int) -> int:
    """Size of one chunk file: the header block and the payload, padded to 4 KiB."""
    return PAYLOAD_OFFSET + _aligned(payload_bytes)


def read_header(path: Path) -> bytes:
    """The header bytes of a chunk file (for scans and inspection; unverified)."""
    with open(path, "rb", buffering=0) as f:
        return f.read(HEADER_BYTES)


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


def _write_all(fd: int, parts: list[memoryview]) -> None:
    total = sum(len(p) for p in parts)
    written = os.writev(fd, parts)
    if written < total:  # short write (rare): finish it piece by piece
        rest = memoryview(b"".join(bytes(p) for p in parts))[written:]
        while rest:
            rest = rest[os.write(fd, rest) :]


def _read_all(fd: int, parts: list[memoryview]) -> int:
    """Fill ``parts`` from ``fd`` until end of file; the bytes read."""
    total = 0
    while parts:
        n = os.readv(fd, parts)
        if n <= 0:
            break
        total += n
        while parts and n >= len(parts[0]):
            n -= len(parts[0])
            parts = parts[1:]
        if parts and n:
            parts = [parts[0][n:], *parts[1:]]
    return total


def _is_aligned(view: memoryview) -> bool:
    """Page-aligned start and length (what O_DIRECT needs from memory)."""
    if len(view) % ALIGN or view.readonly:
        return False
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) % ALIGN == 0
