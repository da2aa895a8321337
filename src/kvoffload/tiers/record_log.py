"""The announcement records of a persistent tier's chunks, kept beside them so that an
engine restarted on a warm tier can tell routers what it holds (issue 34).

A router credits an engine with what its event stream announced; a chunk's event
needs the chunk's vLLM block hashes and token ids (``adapters/vllm/share_records.py``),
which the tier's own bytes do not carry. The scheduler half appends each chunk's
record when the chunk becomes readable in the tier; at start-up it reads back the
records of the chunks the tier recovered, and announces them.

File: ``announce.log`` in the tier's namespace directory (private, like the slabs:
opened ``O_NOFOLLOW`` and checked, created ``O_EXCL``), a sequence of entries::

    16 B chunk key | u32 record length | u32 xxh32 of key and record | record

A torn tail (a crash mid-append) or a damaged entry ends the read (counted in
``damaged``); records past :data:`MAX_RECORD` bytes are never written. The file is
rewritten (atomically) with the recovered chunks' records when opened, and again
from the caller's live records when it has grown to several times what they need
(:meth:`RecordLog.needs_compaction`). Records are descriptive: a record that does
not describe its key is rejected when decoded, never served.

Ownership: the scheduler half of the engine that holds the tier (its lock) owns the
file; one thread calls it. I/O errors are counted (``failures``), never raised:
announcements are best effort, the tier's chunks are unaffected.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import xxhash

from kvoffload.core.keys import KEY_BYTES, ChunkKey
from kvoffload.core.private_files import FilePolicy, open_or_create, replace_atomically

FILE_NAME = "announce.log"
MAX_RECORD = 256 << 10
_HEAD = struct.Struct("<II")
_READ_LIMIT = 1 << 30


def _entry(key: ChunkKey, record: bytes) -> bytes:
    digest = xxhash.xxh32_intdigest(key + record)
    return key + _HEAD.pack(len(record), digest) + record


class RecordLog:
    """One tier's record file (see the module docstring)."""

    def __init__(
        self, directory: Path, policy: FilePolicy, present: Callable[[], Iterable[ChunkKey]]
    ) -> None:
        """``present``: the keys the tier holds now (what :meth:`recover` keeps)."""
        self.path = directory / FILE_NAME
        self.present = present
        self.policy = policy
        self.damaged = 0  # entries that ended a read: torn or corrupt
        self.failures = 0  # reads or writes that failed
        self._entries = 0  # entries in the file now
        self._next_check = 1024  # entries at which needs_compaction counts live ones
        self._fd = -1

    def recover(self) -> list[tuple[ChunkKey, bytes]]:
        """The last record of each key the tier holds, in file order; the file is
        then rewritten with exactly those."""
        wanted = set(self.present())
        found: dict[ChunkKey, bytes] = {}
        for key, record in self._read():
            if key in wanted:
                found.pop(key, None)
                found[key] = record
        entries = list(found.items())
        self.rewrite(entries)
        return entries

    def append(self, entries: Sequence[tuple[ChunkKey, bytes]]) -> None:
        """Append the records of chunks that became readable (one write)."""
        data = b"".join(_entry(k, r) for k, r in entries if len(r) <= MAX_RECORD)
        if not data:
            return
        try:
            if self._fd < 0:
                self._fd = open_or_create(self.path, os.O_WRONLY | os.O_APPEND, self.policy)
            os.write(self._fd, data)
            self._entries += len(entries)
        except OSError:
            self.failures += 1

    def needs_compaction(self, live: Callable[[], int]) -> bool:
        """Whether the file holds more than four times the live records (and 1,024).
        ``live()`` counts them, and is called at most once per ``max(live, 1024)``
        entries appended (so the answer may come that many entries late)."""
        if self._entries < self._next_check:
            return False
        n = live()
        if self._entries > max(4 * n, 1024):
            return True
        self._next_check = self._entries + max(n, 1024)
        return False

    def rewrite(self, entries: Sequence[tuple[ChunkKey, bytes]]) -> None:
        """Make the file anew with exactly ``entries``."""
        data = b"".join(_entry(k, r) for k, r in entries if len(r) <= MAX_RECORD)
        self.close()
        try:
            replace_atomically(self.path, self.policy, lambda fd: _write_all(fd, data))
            self._entries = len(entries)
            self._next_check = max(4 * len(entries), 1024) + 1
        except OSError:
            self.failures += 1

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _read(self) -> list[tuple[ChunkKey, bytes]]:
        try:
            fd = open_or_create(self.path, os.O_RDONLY, self.policy)
        except OSError:
            self.failures += 1
            return []
        try:
            size = min(os.fstat(fd).st_size, _READ_LIMIT)
            data = os.pread(fd, size, 0)
        except OSError:
            self.failures += 1
            return []
        finally:
            os.close(fd)
        out: list[tuple[ChunkKey, bytes]] = []
        at = 0
        while at < len(data):
            head_end = at + KEY_BYTES + _HEAD.size
            if head_end > len(data):
                self.damaged += 1
                break
            key = ChunkKey(data[at : at + KEY_BYTES])
            n, digest = _HEAD.unpack_from(data, at + KEY_BYTES)
            record = data[head_end : head_end + n]
            if n > MAX_RECORD or len(record) != n or xxhash.xxh32_intdigest(key + record) != digest:
                self.damaged += 1
                break
            out.append((key, record))
            at = head_end + n
        return out


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
