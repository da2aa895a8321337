"""The share's readable set in shared memory: lookups without a round trip.

The node process is its only writer; engines read it directly. It answers one
question, fast: which keys are readable (READY or PINNED) now. It is advisory: an
engine's hit is confirmed by ``prepare_load`` at the node process, which may refuse
(another engine evicted the chunk meanwhile, or a read raced a write), a miss the
engine recomputes. Everything else (pending stores, pins, slots) stays in the node
process's directory.

File ``index`` of the share's directory (opened and made as
:mod:`kvoffload.core.private_files` says; its space reserved when it is made)::

    offset 0      4 KiB header: magic b"KVSI", u32 version, u64 generation, u64 capacity
    offset 4096   capacity rows of three u64: key bytes 0-8, key bytes 8-16, state

A table with open addressing (linear probing from ``key[8:16] & (capacity - 1)``;
keys are uniform hashes; state 0 empty, 1 readable), a power of two of at least eight
rows per slot: at most an eighth full, so runs are short and always end. Removal
shifts the rows after the removed one back (no tombstones: the table never
degrades). The writer writes a row's key before its state. A reader that meets a row
mid-write or mid-shift sees a key that does not match or an empty row: a miss. A hit
for a chunk no longer readable needs a read to interleave, within nanoseconds, with
that chunk's removal and another key moving into its row; ``prepare_load`` refuses
it then, like any hit that lost a race.

A node process zeroes the table and writes its generation when it starts: engines
ignore a table of another generation than the node process they are connected to, and
any table while no node process holds the share's server lock.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Iterable, Sequence

import numpy as np
import numpy.typing as npt

from kvoffload.core.errors import ConfigError
from kvoffload.core.keys import ChunkKey
from kvoffload.core.private_files import open_checked, replace_atomically
from kvoffload.share.paths import SharePaths
from kvoffload.share.slab_files import allocate, reserve

HEADER_BYTES = 4096
EMPTY, READABLE = 0, 1
_HEADER = struct.Struct("<4sIQQ")
_MAGIC = b"KVSI"
_VERSION = 1


def capacity_for(num_slots: int) -> int:
    return max(1024, 1 << (8 * num_slots - 1).bit_length())


def _keys(keys: Sequence[ChunkKey]) -> npt.NDArray[np.uint64]:
    return np.frombuffer(b"".join(keys), dtype="<u8").reshape(-1, 2)


class _Table:
    def __init__(self, paths: SharePaths, writable: bool) -> None:
        path = paths.index
        fd = open_checked(path, os.O_RDWR if writable else os.O_RDONLY, paths.policy)
        try:
            access = mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ
            self._map = mmap.mmap(fd, 0, access=access)
        finally:
            os.close(fd)
        magic, version, _, capacity = _HEADER.unpack_from(self._map)
        if magic != _MAGIC or version != _VERSION:
            raise ValueError(f"{path} is not a share index")
        self.capacity = int(capacity)
        self.mask = np.uint64(self.capacity - 1)
        self.rows: npt.NDArray[np.uint64] = np.frombuffer(
            self._map, dtype="<u8", count=3 * self.capacity, offset=HEADER_BYTES
        ).reshape(self.capacity, 3)

    @property
    def generation(self) -> int:
        return int(struct.unpack_from("<Q", self._map, 8)[0])


class IndexReader:
    """An engine's read-only view of the index (see the module docstring); opening
    it raises ``OSError``, ``ValueError`` (not an index) or :class:`ConfigError`
    (a file this share does not trust)."""

    def __init__(self, paths: SharePaths) -> None:
        self._table = _Table(paths, writable=False)

    @property
    def generation(self) -> int:
        return self._table.generation

    def readable_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """How many leading ``keys`` the index holds as readable."""
        if not keys:
            return 0
        table = self._table
        packed = np.frombuffer(b"".join(keys), dtype="<u8")
        hi, lo = packed[0::2], packed[1::2]
        at = (lo & table.mask).astype(np.intp)
        pending = np.arange(len(keys))  # keys whose row is not found yet, in order
        found = np.zeros(len(keys), dtype=bool)
        rows = table.rows
        for _ in range(table.capacity):  # each round moves on by one row; a run ends
            row = rows[at]
            same = (row[:, 1] == lo) & (row[:, 0] == hi)
            readable = row[:, 2] == READABLE
            found[pending[same & readable]] = True
            more = readable & ~same  # another key's row: probe the next one
            if not more.any():
                break
            pending, hi, lo = pending[more], hi[more], lo[more]
            at = (at[more] + 1) & (table.capacity - 1)
        return len(keys) if found.all() else int(np.argmin(found))


class IndexWriter:
    """The node process's side: keeps (zeroed) or makes anew the file, and keeps it
    equal to the readable set of its directory. One thread calls it. No space for a
    new file: :class:`ConfigError` naming ``host_share_root``."""

    def __init__(self, paths: SharePaths, num_slots: int, generation: int) -> None:
        capacity = capacity_for(num_slots)
        size = HEADER_BYTES + 24 * capacity
        head = _HEADER.pack(_MAGIC, _VERSION, 0, capacity)  # generation 0 while cleared
        if not _reusable(paths, size, head):
            reserve(paths, size, "its index")

            def make(fd: int) -> None:
                allocate(paths, fd, size)
                os.pwrite(fd, head, 0)

            replace_atomically(paths.index, paths.policy, make)
        self._table = _Table(paths, writable=True)
        self._table.rows[:] = 0
        struct.pack_into("<Q", self._table._map, 8, generation)

    def insert(self, keys: Iterable[ChunkKey]) -> None:
        table = self._table
        mask = table.capacity - 1
        for hi, lo in _keys(list(keys)).tolist():
            at = lo & mask
            while table.rows[at, 2] == READABLE:
                at = (at + 1) & mask
            self._put(at, hi, lo)

    def _put(self, at: int, hi: int, lo: int) -> None:
        row = self._table.rows[at]
        row[0], row[1] = hi, lo
        row[2] = READABLE  # last: a reader never sees a half-written hit

    def remove(self, keys: Iterable[ChunkKey]) -> None:
        """Remove each key, shifting the rows after it back (no tombstones)."""
        table = self._table
        mask = table.capacity - 1
        rows = table.rows
        for hi, lo in _keys(list(keys)).tolist():
            at = lo & mask
            while rows[at, 2] == READABLE and not (rows[at, 0] == hi and rows[at, 1] == lo):
                at = (at + 1) & mask
            if rows[at, 2] != READABLE:
                continue  # not indexed
            rows[at, 2] = EMPTY
            hole, probe = at, (at + 1) & mask
            while rows[probe, 2] == READABLE:
                home = int(rows[probe, 1]) & mask
                # Move the row back into the hole unless its home lies in (hole, probe].
                if (probe - home) & mask >= (probe - hole) & mask:
                    self._put(hole, int(rows[probe, 0]), int(rows[probe, 1]))
                    rows[probe, 2] = EMPTY
                    hole = probe
                probe = (probe + 1) & mask


def _reusable(paths: SharePaths, size: int, head: bytes) -> bool:
    """Whether the index file there is this share's, of ``size``: then ``head`` is
    written into it (the table is cleared next); else it is made anew."""
    try:
        fd = open_checked(paths.index, os.O_RDWR, paths.policy)
    except (OSError, ConfigError):
        return False
    try:
        if os.fstat(fd).st_size != size or os.pread(fd, 4, 0) != _MAGIC:
            return False
        os.pwrite(fd, head, 0)
        return True
    finally:
        os.close(fd)
