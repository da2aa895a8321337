"""The share's announcement feed (``share/feed.py``) and an engine's reader of it
(``share/feed_reader.py``): records kept only for readable chunks of the announcing
engine's namespace, dropped and logged when a chunk stops being readable; readers
follow the log, get only their namespace's entries, and resynchronize from a snapshot
after a gap (first read, a cursor older than the window, another node process)."""

from __future__ import annotations

import os

from share_fixtures import ThreadShares

from kvoffload.core.keys import ChunkKey
from kvoffload.share.feed import MAX_RECORD, Change, ShareFeed, unpack_feed
from kvoffload.share.feed_reader import FeedReader
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.paths import SharePaths

GEOMETRY = ShareGeometry(num_slots=4, slot_bytes=4096)


def key(i: int) -> ChunkKey:
    return ChunkKey(bytes([i]) * 16)


def test_records_are_kept_for_readable_chunks_and_their_removal_logged() -> None:
    feed = ShareFeed(epoch=7)
    feed.announce(b"ns", [(key(1), b"r1"), (key(2), b"r2"), (key(3), b"x" * (MAX_RECORD + 1))],
                  readable=[key(1), key(3)])  # fmt: skip
    assert len(feed) == 1 and feed.refused == 2  # key 2 not readable, key 3 too large
    feed.announce(b"ns", [(key(1), b"again")], readable=[key(1)])  # kept once
    feed.removed([key(2), key(1)])  # key 2 had no record: nothing logged for it
    cursor, epoch, resync, entries = unpack_feed(feed.read(b"ns", 0, 7, 1 << 20))
    assert (cursor, epoch, resync) == (2, 7, False)
    # The STORED entry's record is gone with the chunk: the REMOVED entry follows.
    assert entries == [(Change.STORED, key(1), b""), (Change.REMOVED, key(1), b"")]
    assert len(feed) == 0


def test_a_reader_gets_its_namespace_only_and_a_budget_bounds_a_reply() -> None:
    feed = ShareFeed(epoch=3)
    entries = [(key(i), bytes([i]) * 100) for i in range(1, 6)]
    feed.announce(b"a", entries, readable=map(key, range(1, 6)))
    feed.announce(b"b", [(key(9), b"b9")], readable=[key(9)])
    cursor, _, _, entries = unpack_feed(feed.read(b"a", 0, 3, budget=250))
    assert [k for _, k, _ in entries] == [key(1), key(2), key(3)]  # past the budget: stop
    cursor, _, _, entries = unpack_feed(feed.read(b"a", cursor, 3, budget=1 << 20))
    assert [k for _, k, _ in entries] == [key(4), key(5)]
    assert cursor == 6  # namespace b's entry was passed over
    assert feed.records(b"b", [key(9), key(1)]) == b"\x02\x00\x00\x00b9" + b"\x00" * 4
    assert feed.snapshot(b"b")[16:] == key(9)


def test_a_stale_cursor_or_another_epoch_resynchronizes() -> None:
    feed = ShareFeed(epoch=5, window=4)
    for i in range(1, 7):
        feed.announce(b"ns", [(key(i), b"r")], readable=[key(i)])
    assert unpack_feed(feed.read(b"ns", 1, 5, 1 << 20))[2]  # entries 2.. are gone
    assert unpack_feed(feed.read(b"ns", 6, 4, 1 << 20))[2]  # another epoch
    assert unpack_feed(feed.read(b"ns", 99, 5, 1 << 20))[2]  # a cursor from the future
    assert not unpack_feed(feed.read(b"ns", 2, 5, 1 << 20))[2]  # within the window


def test_readers_follow_what_another_engine_stores_and_what_the_share_evicts(
    shares: ThreadShares,
) -> None:
    paths: SharePaths = shares.serve("feed", GEOMETRY)
    a = shares.client(paths, namespace=b"ns", lease=False, users=False)
    b_reader = FeedReader(paths, os.urandom(16), b"ns", timeout_s=30.0)
    other = FeedReader(paths, os.urandom(16), b"other", timeout_s=30.0)
    a_reader = FeedReader(paths, a.session, b"ns", timeout_s=30.0)
    try:
        first = b_reader.poll()
        assert first.full and first.stored == []  # a late attacher's first read: the snapshot
        stored = a.prepare_store([key(1), key(2)])
        a.complete_store(list(stored.keys), True)
        a_reader.send_records([(key(1), b"rec1"), (key(2), b"rec2"), (key(3), b"not stored")])
        update = b_reader.poll()
        assert not update.full and update.stored == [(key(1), b"rec1"), (key(2), b"rec2")]
        assert update.removed == []
        # Four more chunks in a four-slot share: keys 1 and 2 are evicted.
        first_two = a.prepare_store([key(3), key(4)], admit_all=True)
        a.complete_store(list(first_two.keys), True)
        more = a.prepare_store([key(5), key(6)], admit_all=True)
        a.complete_store(list(more.keys), True)
        assert set(more.evicted) == {key(1), key(2)}
        update = b_reader.poll()
        assert set(update.removed) >= {key(1), key(2)}
        assert other.poll().stored == [] and other.poll().stored == []  # not its namespace
        # A reader that starts now gets what the share holds with a record.
        late = FeedReader(paths, os.urandom(16), b"ns", timeout_s=30.0)
        assert late.poll().stored == []  # the chunks that have records were evicted
        late.close()
        a_reader.send_records([(k, b"r" + k[:1]) for k in [*first_two.keys, *more.keys]])
        late = FeedReader(paths, os.urandom(16), b"ns", timeout_s=30.0)
        got = late.poll()
        late.close()
        held = [key(3), key(4), key(5), key(6)]
        assert got.full and [k for k, _ in got.stored] == held
        assert [k for k, _ in b_reader.poll().stored] == held
        victim = held[-1]
        assert a.discard([victim]) == [victim]
        assert b_reader.poll().removed == [victim]
    finally:
        for reader in (a_reader, b_reader, other):
            reader.close()


def test_a_reader_resynchronizes_with_a_new_node_process(shares: ThreadShares) -> None:
    paths = shares.serve("feed-restart", GEOMETRY)
    a = shares.client(paths, namespace=b"ns", lease=False, users=False)
    reader = FeedReader(paths, os.urandom(16), b"ns", timeout_s=30.0)
    a_reader = FeedReader(paths, a.session, b"ns", timeout_s=30.0)
    try:
        stored = a.prepare_store([key(1)])
        a.complete_store(list(stored.keys), True)
        a_reader.send_records([(key(1), b"rec1")])
        assert reader.poll().stored == [(key(1), b"rec1")]
        server, thread = shares.servers.pop()
        server.stop()
        thread.join()
        shares.serve("feed-restart", GEOMETRY)  # a new node process: an empty share
        update = reader.poll()
        while not update.full:  # the connection to the old one failed first
            update = reader.poll()
        assert update.stored == []  # the caller removes what it announced
        assert reader.stats["resyncs"] >= 2
    finally:
        reader.close()
        a_reader.close()
