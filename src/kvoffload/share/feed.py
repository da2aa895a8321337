"""The share's announcement feed: what every engine attached to a share needs to tell
a KV-aware router that it can load a chunk, and when it no longer can (issue 34,
decision 0022).

A router credits an engine with the chunks its event stream announced. A chunk in a
node share can be loaded by every engine attached to it, so each of them must
announce it, not only the one that stored it. The node process keeps, for every
readable chunk whose storing engine sent one, the chunk's **record**: opaque bytes
(the engine's own encoding of the chunk's block hashes and token ids, see
``adapters/vllm/share_records.py``) that any engine of the same namespace can turn into
its own ``BlockStored`` event. And a **log** of numbered changes:

- ``STORED`` when a readable chunk gets its record (the storing engine sends it just
  after the store completes: ``ANNOUNCE``);
- ``REMOVED`` when a chunk that had a record stops being readable (evicted,
  discarded, reset), its record dropped at once.

Engines follow the log from a cursor (``FEED``), and catch up after a gap (a late
attacher, a cursor older than the log's bounded window) from a snapshot of the
recorded keys (``SNAPSHOT``) and their records (``RECORDS``). Each entry names the
namespace it belongs to; an engine is only given its own namespace's.

Bounds: one record per readable chunk (records of chunks no longer readable are never
kept; a record over :data:`MAX_RECORD` bytes is refused); the log keeps the last
:data:`LOG_WINDOW` entries (older cursors resynchronize from a snapshot); one
``FEED`` reply carries at most ``budget`` bytes of entries.

Ownership: the node process's :class:`~.book.ShareBook` owns the feed and calls it
from its one serving thread (no locking). A record is never parsed here; the engines
that decode it check it (they trust no peer). The feed lives in the node process's
memory: a node process restarted starts with an empty feed (a backed share's restored
chunks have no record until an engine stores them again), and its engines, which see
another generation, resynchronize.
"""

from __future__ import annotations

import enum
import struct
from collections import deque
from collections.abc import Iterable, Sequence

from kvoffload.core.keys import KEY_BYTES, ChunkKey

MAX_RECORD = 256 << 10
"""The largest record kept, in bytes (a chunk of 4,096 tokens with its hashes and extra
keys takes about 20 KiB)."""
LOG_WINDOW = 1 << 16
"""How many log entries the feed keeps; a cursor older than that resynchronizes."""
FEED_HEAD = struct.Struct("<QQB")  # next cursor, the feed's epoch, resync flag
ENTRY_HEAD = struct.Struct("<BI")  # kind, record length (the key follows, then the record)
CURSOR = struct.Struct("<QQI")  # since, epoch, budget


class Change(enum.IntEnum):
    STORED = 1
    REMOVED = 2


class ShareFeed:
    """Records and change log of one node process (see the module docstring)."""

    def __init__(self, epoch: int, window: int = LOG_WINDOW) -> None:
        self.epoch = epoch  # the node process's generation: cursors of another are stale
        self._records: dict[ChunkKey, tuple[bytes, bytes]] = {}  # key -> (namespace, record)
        self._log: deque[tuple[int, Change, ChunkKey, bytes]] = deque(maxlen=window)
        self._next = 1  # the next entry's sequence number
        self.refused = 0  # records refused: too large, or for a chunk not readable

    def __len__(self) -> int:
        return len(self._records)

    # ------------------------------------------------------------ the node's changes

    def announce(self, namespace: bytes, entries: Iterable[tuple[ChunkKey, bytes]],
                 readable: Iterable[ChunkKey]) -> None:  # fmt: skip
        """Keep the records of ``entries`` whose key is in ``readable`` (the caller's
        readable set) and has none yet; log each as STORED."""
        ok = set(readable)
        for key, record in entries:
            if key not in ok or len(record) > MAX_RECORD:
                self.refused += 1
                continue
            if key in self._records:
                continue
            self._records[key] = (namespace, record)
            self._append(Change.STORED, key, namespace)

    def removed(self, keys: Iterable[ChunkKey]) -> None:
        """``keys`` are no longer readable: drop their records, log each that had one."""
        for key in keys:
            held = self._records.pop(key, None)
            if held is not None:
                self._append(Change.REMOVED, key, held[0])

    def _append(self, change: Change, key: ChunkKey, namespace: bytes) -> None:
        self._log.append((self._next, change, key, namespace))
        self._next += 1

    # ------------------------------------------------------------ the engines' reads

    def read(self, namespace: bytes, since: int, epoch: int, budget: int) -> bytes:
        """``FEED``'s reply: the entries of ``namespace`` after cursor ``since``, up to
        ``budget`` bytes (at least one entry), each STORED with its record (empty when
        the chunk was removed since: a REMOVED entry follows). Resync flag set (and no
        entries) when the cursor is of another epoch or older than the log keeps."""
        first = self._log[0][0] if self._log else self._next
        if epoch != self.epoch or since + 1 < first or since >= self._next:
            return FEED_HEAD.pack(self._next - 1, self.epoch, 1)
        parts: list[bytes] = []
        size, cursor = 0, since
        start = since + 1 - first  # the entry after the cursor's index in the log
        for i in range(start, len(self._log)):
            seq, change, key, ns = self._log[i]
            if size >= budget and parts:
                break
            cursor = seq
            if ns != namespace:
                continue
            record = b""
            if change is Change.STORED:
                held = self._records.get(key)
                record = held[1] if held is not None else b""
            part = ENTRY_HEAD.pack(change, len(record)) + key + record
            parts.append(part)
            size += len(part)
        return FEED_HEAD.pack(cursor, self.epoch, 0) + b"".join(parts)

    def snapshot(self, namespace: bytes) -> bytes:
        """``SNAPSHOT``'s reply: the cursor now, the epoch, and every key of
        ``namespace`` that has a record."""
        keys = [k for k, (ns, _) in self._records.items() if ns == namespace]
        return struct.pack("<QQ", self._next - 1, self.epoch) + b"".join(keys)

    def records(self, namespace: bytes, keys: Sequence[ChunkKey]) -> bytes:
        """``RECORDS``' reply: per key a u32 length and its record (length 0: none,
        or another namespace's)."""
        parts: list[bytes] = []
        for key in keys:
            held = self._records.get(key)
            record = held[1] if held is not None and held[0] == namespace else b""
            parts.append(struct.pack("<I", len(record)) + record)
        return b"".join(parts)


def pack_announce(entries: Sequence[tuple[ChunkKey, bytes]]) -> bytes:
    """``ANNOUNCE``'s payload: per entry a key, a u32 length and the record."""
    return b"".join(key + struct.pack("<I", len(rec)) + rec for key, rec in entries)


def unpack_announce(data: bytes) -> list[tuple[ChunkKey, bytes]]:
    """The entries of an ``ANNOUNCE`` payload (``ValueError`` if it is not one)."""
    out: list[tuple[ChunkKey, bytes]] = []
    at = 0
    while at < len(data):
        key = ChunkKey(data[at : at + KEY_BYTES])
        (n,) = struct.unpack_from("<I", data, at + KEY_BYTES)
        at += KEY_BYTES + 4
        if len(key) != KEY_BYTES or at + n > len(data):
            raise ValueError("truncated ANNOUNCE entry")
        out.append((key, data[at : at + n]))
        at += n
    return out


def unpack_feed(data: bytes) -> tuple[int, int, bool, list[tuple[Change, ChunkKey, bytes]]]:
    """A ``FEED`` reply: the next cursor, the epoch, the resync flag, the entries
    (``ValueError``/``struct.error`` if it is not one)."""
    cursor, epoch, resync = FEED_HEAD.unpack_from(data)
    at = FEED_HEAD.size
    entries: list[tuple[Change, ChunkKey, bytes]] = []
    while at < len(data):
        kind, n = ENTRY_HEAD.unpack_from(data, at)
        at += ENTRY_HEAD.size
        key = ChunkKey(data[at : at + KEY_BYTES])
        at += KEY_BYTES
        if len(key) != KEY_BYTES or at + n > len(data):
            raise ValueError("truncated FEED entry")
        entries.append((Change(kind), key, data[at : at + n]))
        at += n
    return cursor, epoch, bool(resync), entries


def unpack_records(data: bytes, count: int) -> list[bytes]:
    """A ``RECORDS`` reply for ``count`` keys (``ValueError`` if it is not one)."""
    out: list[bytes] = []
    at = 0
    for _ in range(count):
        (n,) = struct.unpack_from("<I", data, at)
        at += 4
        if at + n > len(data):
            raise ValueError("truncated RECORDS entry")
        out.append(data[at : at + n])
        at += n
    return out
