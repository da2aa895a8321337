"""The local-disk tier: one preallocated slab file per namespace and parallel rank.

Layout under ``root``::

    root/kvoffload-v1/<namespace digest hex>/slab.r<rank>
    root/kvoffload-v1/<namespace digest hex>/lock

The lock file is held by the one engine using the namespace
(:mod:`kvoffload.tiers.disk_lock`); a second engine is refused at start.

A slab is a 4 KiB superblock (:mod:`kvoffload.tiers.slab_format`: geometry, for
inspection and recovery) and ``num_slots`` fixed-size slots. The scheduler half's
disk directory assigns every chunk a slot; all ranks store their share of a chunk
in the same slot of their own slab. A slot is a 4 KiB header block (the
:mod:`kvoffload.core.chunk_format` header, then the chunk key and a write sequence
number, zero-padded) and the payload, zero-padded to whole pages. Writing a chunk
is one positioned write into an existing, preallocated file: no file is created,
renamed or deleted per chunk (file creation costs 0.1-1.5 ms on the machines
measured, more than writing 256 KiB), and the tier never runs out of inodes.

Torn writes: a write interrupted by a crash leaves a header whose checksum does not
match its payload (or an older header whose checksum no longer matches): every
read verifies the header against the expected namespace, rank key and length and
the payload against the checksum, so a torn slot is a counted miss, never data.
Start-up recovery (:mod:`kvoffload.tiers.disk_index`) adopts a slot only when every
rank's header names the same chunk. Evicted chunks are not erased; the next chunk
written to the slot replaces them. A slot found bad on read is cleared.

With ``o_direct`` reads and writes bypass the page cache. The payload is
page-aligned in the file, so a page-aligned caller buffer (a host slab slot) is
written and read in place with no copy; other buffers go through a per-thread
bounce buffer. Where the filesystem refuses O_DIRECT the store uses buffered I/O.
The slab is preallocated at start (``posix_fallocate``) so a full disk is reported
then, as a :class:`~kvoffload.core.errors.ConfigError` naming ``disk_bytes``, not
in the middle of serving; filesystems without preallocation get a sparse file.
Files and directories are created owner-only (0600 / 0700).

KV cache groups: a slab holds the chunks of every group of its layout (``groups`` of
them, one chunk per group and chunk of tokens, each under its own key); the header of
each records its group (:mod:`kvoffload.core.chunk_format`). The caller passes the
group a chunk is written as and the group it expects when reading it back: the
store keeps no group of its own.

Attached stores: with a disk tier shared by the engines of a node (a disk share,
:mod:`kvoffload.tiers.disk_backing`) the share's node process owns the slab files'
shape: it creates, sizes and preallocates them and writes their superblocks. An
engine's worker opens its rank's slab with ``attach=True``: the file must exist with
a superblock of exactly this namespace, rank, payload size and slot count (else a
:class:`~kvoffload.core.errors.ConfigError` naming ``disk_path``), and is opened
without being created, resized, preallocated or rewritten.

Write sequence numbers: each write's is the wall clock in nanoseconds, or the
previous one + 1 if that is larger, so copies written by different processes (the
engines of a disk share) compare by when they were written.

Thread-safety: calls on different slots may run concurrently (the scheduler half
never has two jobs on one slot). Errors: ``read_into`` raises
:class:`~kvoffload.core.chunk_format.IntegrityError` for a bad slot; I/O errors
raise ``OSError``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import struct
import threading
import time
from pathlib import Path

from kvoffload.core.chunk_format import (
    HEADER_BYTES,
    IntegrityError,
    IntegrityReason,
    check_header,
    check_payload,
    encode_header,
)
from kvoffload.core.errors import ConfigError
from kvoffload.core.keys import ChunkKey, shard_key
from kvoffload.core.private_files import open_checked, open_or_create, same_file
from kvoffload.tiers.disk_files import FORMAT_DIR, disk_policy, private_namespace_dir
from kvoffload.tiers.slab_format import SUPERBLOCK_BYTES, Superblock, SuperblockError

ALIGN = 4096
PAYLOAD_OFFSET = ALIGN  # within a slot: the header block, then the payload
KEY_OFFSET = HEADER_BYTES  # within the header block: the chunk key (16 bytes) ...
_TRAILER = struct.Struct("<16sQ")  # ... and the write sequence number
_ZERO_BLOCK = bytes(ALIGN)


def namespace_dir(root: Path, namespace_digest: bytes) -> Path:
    return Path(root) / FORMAT_DIR / namespace_digest.hex()


def slab_path(root: Path, namespace_digest: bytes, rank: int) -> Path:
    return namespace_dir(root, namespace_digest) / f"slab.r{rank}"


def slot_bytes(payload_bytes: int) -> int:
    """Size of one slot: the header block and the payload, padded to 4 KiB."""
    return PAYLOAD_OFFSET + _aligned(payload_bytes)


def slab_bytes(payload_bytes: int, num_slots: int) -> int:
    return SUPERBLOCK_BYTES + num_slots * slot_bytes(payload_bytes)


def parse_header_block(block: bytes | memoryview) -> tuple[ChunkKey, int]:
    """The chunk key and write sequence number stored after a slot's header."""
    key, seq = _TRAILER.unpack_from(block, KEY_OFFSET)
    return ChunkKey(key), int(seq)


class DiskStore:
    """One rank's slab of one namespace: ``num_slots`` chunks of ``payload_bytes``."""

    def __init__(
        self,
        root: Path,
        namespace_digest: bytes,
        rank: int,
        payload_bytes: int,
        num_slots: int,
        *,
        o_direct: bool = False,
        groups: int = 1,
        attach: bool = False,
    ) -> None:
        self.path = slab_path(root, namespace_digest, rank)
        self.groups = groups  # the layout's KV cache groups, recorded in every header
        self.digest = namespace_digest
        self.rank = rank
        self.payload_bytes = payload_bytes
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes(payload_bytes)
        self.o_direct = o_direct and hasattr(os, "O_DIRECT")
        self._pad = bytes(self.slot_bytes - PAYLOAD_OFFSET - payload_bytes)
        self._last_seq = 0  # newest copy wins at recovery
        self._seq_lock = threading.Lock()
        self._buffers = threading.local()  # per-thread aligned buffers (O_DIRECT)
        superblock = Superblock(namespace_digest, rank, payload_bytes, num_slots)
        self._direct_fd = -1
        self._policy = disk_policy(root)
        if attach:
            self._fd = self._attach(superblock)
        else:
            private_namespace_dir(root, namespace_digest)
            self._fd = open_or_create(self.path, os.O_RDWR, self._policy)
        try:
            if not attach:
                self._prepare(superblock)
            self._open_direct()
        except BaseException:
            os.close(self._fd)
            raise

    def _attach(self, wanted: Superblock) -> int:
        """Open the existing slab, checking its superblock is ``wanted``."""
        try:
            fd = open_checked(self.path, os.O_RDWR, self._policy)
        except FileNotFoundError:
            raise ConfigError(
                "disk_path", f"{self.path} does not exist: the disk share did not create it"
            ) from None
        try:
            found: Superblock | str = Superblock.decode(os.pread(fd, SUPERBLOCK_BYTES, 0))
        except SuperblockError as exc:
            found = str(exc)
        if found != wanted:
            os.close(fd)
            raise ConfigError(
                "disk_path",
                f"{self.path} is not the slab this worker expects ({wanted}): found {found}",
            )
        return fd

    def _prepare(self, superblock: Superblock) -> None:
        size = slab_bytes(self.payload_bytes, self.num_slots)
        if os.fstat(self._fd).st_size != size:
            os.ftruncate(self._fd, size)  # grows sparse, or drops slots past the capacity
        try:
            os.posix_fallocate(self._fd, 0, size)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                raise ConfigError(
                    "disk_bytes", f"cannot reserve {size} bytes in {self.path.parent}: disk full"
                ) from None
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
        os.pwrite(self._fd, superblock.encode(), 0)

    def _open_direct(self) -> None:
        if self.o_direct:
            try:
                flags = os.O_RDWR | os.O_DIRECT | os.O_NOFOLLOW | _CLOEXEC
                self._direct_fd = os.open(self.path, flags)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.o_direct = False  # e.g. tmpfs
                return
            if not same_file(self.path, os.fstat(self._fd)) or not same_file(
                self.path, os.fstat(self._direct_fd)
            ):
                os.close(self._direct_fd)  # the name was replaced meanwhile: not ours
                self._direct_fd = -1
                raise self._policy.refuse(self.path, "was replaced while it was opened")

    def close(self) -> None:
        for fd in (self._fd, self._direct_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fd = self._direct_fd = -1

    def offset(self, slot: int) -> int:
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} outside 0..{self.num_slots - 1}")
        return SUPERBLOCK_BYTES + slot * self.slot_bytes

    def write(self, slot: int, key: ChunkKey, payload: memoryview, group: int = 0) -> None:
        """Store ``payload`` as ``key``'s chunk, of KV cache group ``group``, in ``slot``
        (replacing what was there)."""
        offset = self.offset(slot)
        head = self._head_block()
        head[:HEADER_BYTES] = encode_header(
            self.digest, shard_key(key, self.rank), payload, group=group, groups=self.groups
        )
        _TRAILER.pack_into(head, KEY_OFFSET, key, self._next_seq())
        if self.o_direct and _is_aligned(payload) and not self._pad:
            parts = [head, payload]
        elif self.o_direct:
            bounce = self._bounce()
            bounce[: len(payload)] = payload
            bounce[len(payload) :] = self._pad
            parts = [head, bounce]
        else:
            parts = [head, payload, memoryview(self._pad)]
        fd = self._direct_fd if self.o_direct else self._fd
        written = os.pwritev(fd, parts, offset)
        if written != self.slot_bytes:
            raise OSError(errno.EIO, f"short write ({written} of {self.slot_bytes} bytes)")

    def read_into(self, slot: int, key: ChunkKey, out: memoryview, group: int = 0) -> None:
        """Read and verify ``key``'s chunk, of KV cache group ``group``, from ``slot``
        into ``out`` (``payload_bytes``)."""
        offset = self.offset(slot)
        head = self._head_block()
        if not self.o_direct:
            got = os.preadv(self._fd, [head, out], offset) - PAYLOAD_OFFSET
        elif _is_aligned(out):  # straight into the caller's memory
            got = os.preadv(self._direct_fd, [head, out], offset) - PAYLOAD_OFFSET
        else:
            bounce = self._bounce()
            got = os.preadv(self._direct_fd, [head, bounce], offset) - PAYLOAD_OFFSET
            out[:] = bounce[: len(out)]
        storage_key = shard_key(key, self.rank)
        expected = check_header(
            head[:HEADER_BYTES], self.digest, storage_key, len(out), group=group
        )
        if parse_header_block(head)[0] != key:
            raise IntegrityError(IntegrityReason.KEY, "chunk key after the header")
        check_payload(out[: max(0, min(got, len(out)))], len(out), expected)

    def clear(self, slot: int) -> None:
        """Erase ``slot``'s header (a bad copy: never read or recovered again)."""
        os.pwrite(self._fd, _ZERO_BLOCK[: HEADER_BYTES + _TRAILER.size], self.offset(slot))

    # ------------------------------------------------------------ internals

    def _next_seq(self) -> int:
        with self._seq_lock:
            self._last_seq = max(time.time_ns(), self._last_seq + 1)
            return self._last_seq

    def _head_block(self) -> memoryview:
        head = self._thread_buffer("head", PAYLOAD_OFFSET)
        head[HEADER_BYTES:] = _ZERO_BLOCK[HEADER_BYTES:]
        return head

    def _bounce(self) -> memoryview:
        return self._thread_buffer("bounce", self.slot_bytes - PAYLOAD_OFFSET)

    def _thread_buffer(self, name: str, size: int) -> memoryview:
        """This thread's page-aligned buffer ``name`` (allocated once per thread and
        kept for the store's lifetime: O_DIRECT needs aligned memory)."""
        buf: memoryview | None = getattr(self._buffers, name, None)
        if buf is None:
            buf = memoryview(mmap.mmap(-1, size))
            setattr(self._buffers, name, buf)
        return buf


_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def _is_aligned(view: memoryview) -> bool:
    """Page-aligned start and length (what O_DIRECT needs from memory)."""
    if len(view) % ALIGN or view.readonly:
        return False
    return ctypes.addressof(ctypes.c_char.from_buffer(view)) % ALIGN == 0
