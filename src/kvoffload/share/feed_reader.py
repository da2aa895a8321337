"""One engine's reader of its share's announcement feed (:mod:`.feed`): sends the
records of chunks this engine stored, and follows what the share holds.

:meth:`FeedReader.poll` answers what changed since the last poll as a
:class:`FeedUpdate`. After a gap (the first poll, a node process restarted or
replaced, a cursor the feed's window no longer covers) it answers the whole set of
the namespace's recorded chunks instead (``full``): the caller then removes whatever
it announced that is not in it.

Uses a connection of its own (a :class:`~.link.Link` under the engine's session and
namespace, which never starts a node process), so that one thread (the announcer's)
calls it beside the scheduler half's directory. Never raises for the share: a call
the share does not answer, or answers with bytes that are not a reply, ends the poll
with what it had (counted in ``stats``), and the next poll resynchronizes.
"""

from __future__ import annotations

import struct
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvoffload.core.errors import ContractViolation
from kvoffload.core.keys import KEY_BYTES, ChunkKey
from kvoffload.share.feed import CURSOR, Change, pack_announce, unpack_feed, unpack_records
from kvoffload.share.link import CALL_TIMEOUT_S, Link
from kvoffload.share.paths import SharePaths
from kvoffload.share.protocol import FrameError, Op, pack_keys

FEED_TIMEOUT_S = 2.0  # the least deadline of a feed call (the announcer's thread waits)
FEED_BUDGET = 1 << 20  # bytes of entries per FEED reply
RECORDS_BATCH = 1024  # keys per RECORDS call while resynchronizing
ANNOUNCE_BATCH = 1 << 20  # bytes per ANNOUNCE frame


@dataclass
class FeedUpdate:
    """What changed: ``stored`` (key, record) in feed order, ``removed`` keys;
    ``full``: ``stored`` is the whole set now (remove what is not in it)."""

    stored: list[tuple[ChunkKey, bytes]] = field(default_factory=list)
    removed: list[ChunkKey] = field(default_factory=list)
    full: bool = False


class FeedReader:
    """See the module docstring. One thread calls it."""

    def __init__(
        self,
        paths: SharePaths,
        session: bytes,
        namespace: bytes,
        *,
        timeout_s: float = CALL_TIMEOUT_S,
    ) -> None:
        self.link = Link(paths, session, namespace, None, timeout_s=timeout_s,
                         start_server=False)  # fmt: skip
        self._cursor = 0
        self._epoch = 0  # 0: never read (the next poll resynchronizes)
        self.stats: Counter[str] = Counter()

    def send_records(self, entries: Sequence[tuple[ChunkKey, bytes]]) -> None:
        """Send the records of chunks this engine made readable (one-way, batched)."""
        batch: list[tuple[ChunkKey, bytes]] = []
        size = 0
        for key, record in entries:
            batch.append((key, record))
            size += len(record) + KEY_BYTES + 4
            if size >= ANNOUNCE_BATCH:
                self._send(batch)
                batch, size = [], 0
        if batch:
            self._send(batch)

    def _send(self, batch: list[tuple[ChunkKey, bytes]]) -> None:
        if self.link.send(Op.ANNOUNCE, pack_announce(batch)):
            self.stats["records_sent"] += len(batch)
        else:
            self.stats["records_unsent"] += len(batch)

    def poll(self) -> FeedUpdate:
        """What changed since the last poll (see the module docstring)."""
        try:
            if self._epoch == 0:
                return self._resync()
            update = FeedUpdate()
            while True:
                reply = self._call(Op.FEED, CURSOR.pack(self._cursor, self._epoch, FEED_BUDGET))
                if reply is None:
                    return update
                cursor, epoch, resync, entries = unpack_feed(reply)
                if resync:  # the whole set replaces what was read so far
                    return self._resync()
                for change, key, record in entries:
                    if change is Change.STORED:
                        if record:
                            update.stored.append((key, record))
                    else:
                        update.removed.append(key)
                done = cursor == self._cursor
                self._cursor, self._epoch = cursor, epoch
                if done or not entries:
                    return update
        except (ValueError, struct.error, FrameError, ContractViolation):
            self.stats["bad_replies"] += 1
            self._epoch = 0
            self.link.drop()
            return FeedUpdate()

    @property
    def epoch(self) -> int:
        """The epoch of the node process last read (0: none yet, or a gap)."""
        return self._epoch

    def forget_cursor(self) -> None:
        """The next poll reads the whole set again (a re-announcement)."""
        self._epoch = 0

    def _resync(self) -> FeedUpdate:
        reply = self._call(Op.SNAPSHOT, b"")
        if reply is None:
            return FeedUpdate()
        cursor, epoch = struct.unpack_from("<QQ", reply)
        body = reply[16:]
        if len(body) % KEY_BYTES:
            raise ValueError("SNAPSHOT keys")
        keys = [ChunkKey(body[i : i + KEY_BYTES]) for i in range(0, len(body), KEY_BYTES)]
        update = FeedUpdate(full=True)
        for start in range(0, len(keys), RECORDS_BATCH):
            batch = keys[start : start + RECORDS_BATCH]
            got = self._call(Op.RECORDS, pack_keys(batch))
            if got is None:
                return FeedUpdate()  # try again at the next poll (epoch still 0)
            records = unpack_records(got, len(batch))
            update.stored.extend((k, r) for k, r in zip(batch, records, strict=True) if r)
        self._cursor, self._epoch = cursor, epoch
        self.stats["resyncs"] += 1
        return update

    def _call(self, op: Op, payload: bytes) -> bytes | None:
        reply = self.link.call(op, payload)
        if reply is None:
            self.stats["unanswered"] += 1
        return reply

    def close(self) -> None:
        self.link.close()
