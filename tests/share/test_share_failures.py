"""A slow, unreachable or forgetful share costs misses and refused stores, counted,
never an exception into the step or a wait; completions are fenced by session."""

from __future__ import annotations

import os
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from share_fixtures import ThreadShares

from kvoffload.core.directory import LookupStatus
from kvoffload.core.errors import ContractViolation
from kvoffload.core.keys import ChunkKey
from kvoffload.core.observe.events import CacheEvent, EventKind
from kvoffload.share.client import ShareDirectory, ShareUnavailable
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.paths import SharePaths
from kvoffload.share.protocol import WELCOME, Op, Status, frame, pack_keys, read_frame

GEOMETRY = ShareGeometry(num_slots=8, slot_bytes=64)
HIT, MISS = LookupStatus.HIT, LookupStatus.MISS


def K(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def assert_answers_as_empty(d: ShareDirectory) -> None:
    assert d.lookup([K(1), K(2)]).statuses == (MISS, MISS)
    assert d.readable_prefix([K(1)]) == 0
    assert d.prepare_store([K(1)]).no_room
    d.touch([K(1)])
    d.record_lookups([K(1)])
    assert d.try_prepare_load([K(1)]) is None
    with pytest.raises(ShareUnavailable):
        d.prepare_load([K(1)])
    assert d.free_slots == 0 and d.evictable_count == 0 and d.discard([K(1)]) == []


def test_an_unreachable_share_answers_misses_and_refusals(share_root: Path) -> None:
    d = ShareDirectory(SharePaths("absent", share_root), start_server=False, retry_s=3600.0)
    try:
        assert_answers_as_empty(d)
        assert d.link.stats["unavailable"] == 10 and d.link.stats["connects"] == 0
        assert d.metrics.value("no_room_total") == 1
    finally:
        d.close()


@pytest.fixture
def mute_share(share_root: Path) -> Iterator[SharePaths]:
    """A node process that welcomes one connection, then never answers a call."""
    paths = SharePaths("mute", share_root)
    paths.ensure_dir()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(paths.socket))
    listener.listen(4)
    done = threading.Event()

    def serve() -> None:
        conn, _ = listener.accept()
        read_frame(conn)
        conn.sendall(frame(Status.OK, WELCOME.pack(1, os.getpid(), 8, 64, 1, 1, bytes(16))))
        done.wait()
        conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield paths
    finally:
        done.set()
        thread.join()
        listener.close()


def test_a_share_that_stops_answering_times_out_into_misses(mute_share: SharePaths) -> None:
    d = ShareDirectory(mute_share, start_server=False, lease=False, timeout_s=0.05, retry_s=3600.0)
    try:
        assert d.wait_ready(10.0)
        assert d.lookup([K(1)]).statuses == (MISS,)
        assert d.link.stats["timeouts"] == 1 and not d.link.connected
        assert_answers_as_empty(d)  # and no further wait: the next attempt is later
        assert d.link.stats["timeouts"] == 1
    finally:
        d.close()


def test_bookings_whose_reply_was_lost_are_released_on_reconnection(
    shares: ThreadShares,
) -> None:
    paths = shares.serve("lost", GEOMETRY)
    d = shares.client(paths, retry_s=0.0)
    assert d.lease is not None and d.lease.connected.wait(30.0)  # the session outlives calls
    sock = d.link._sock
    assert sock is not None
    sock.sendall(frame(Op.PREPARE_STORE, struct.pack("<BI", 0, 1) + pack_keys([K(5)])))
    d.link.drop()  # the reply is never read
    counts = d.share_counts()  # reconnects; the same session: bookings are synced
    assert counts is not None and counts.storing == 0 and counts.sessions == 1
    assert d.link.stats["connects"] == 2
    assert d.lookup([K(5)]).statuses == (MISS,)
    d.check_integrity()


def test_an_engine_cannot_complete_another_engines_bookings(shares: ThreadShares) -> None:
    paths = shares.serve("fence", GEOMETRY)
    a, b = shares.client(paths), shares.client(paths)
    a.prepare_store([K(1)])
    with pytest.raises(ContractViolation):
        b.link.call(Op.COMPLETE_STORE, bytes([1]) + pack_keys([K(1)]))
    stored = b.prepare_store([K(2)])
    b.complete_store(stored.keys, success=True)
    b.prepare_load([K(2)])
    with pytest.raises(ContractViolation):
        a.link.call(Op.COMPLETE_LOAD, pack_keys([K(2)]))
    assert a.lookup([K(1), K(2)]).statuses == (LookupStatus.HIT_PENDING, HIT)
    a.check_integrity()


def test_reset_discards_only_the_engines_namespace(shares: ThreadShares) -> None:
    paths = shares.serve("names", GEOMETRY)
    a = shares.client(paths, namespace=b"model-a")
    b = shares.client(paths, namespace=b"model-b")
    for client, key in ((a, K(1)), (b, K(2)), (a, K(3))):
        client.complete_store(client.prepare_store([key]).keys, success=True)
    a.take_events()
    assert sorted(a.reset()) == [K(1), K(3)]
    assert a.take_events() == [CacheEvent(EventKind.REMOVED, (K(1), K(3)), "host")]
    assert b.lookup([K(1), K(2), K(3)]).statuses == (MISS, HIT, MISS)
    assert b.reset() == [K(2)] and len(a) == 0
    a.check_integrity()


def test_events_and_counters_report_this_engines_calls(shares: ThreadShares) -> None:
    paths = shares.serve("events", ShareGeometry(num_slots=1, slot_bytes=64))
    a, b = shares.client(paths), shares.client(paths)
    evicted: list[tuple[ChunkKey, ...]] = []
    b.on_evict = evicted.append
    a.complete_store(a.prepare_store([K(1)]).keys, success=True)
    b.complete_store(b.prepare_store([K(2)]).keys, success=True)
    assert a.take_events() == [CacheEvent(EventKind.STORED, (K(1),), "host")]
    assert b.take_events() == [
        CacheEvent(EventKind.REMOVED, (K(1),), "host"),
        CacheEvent(EventKind.STORED, (K(2),), "host"),
    ]
    assert evicted == [(K(1),)] and b.metrics.value("evictions_total") == 1
    assert a.metrics.value("evictions_total") == 0


def test_a_hit_lost_to_another_engines_eviction_is_refused_at_load(
    shares: ThreadShares,
) -> None:
    paths = shares.serve("race", ShareGeometry(num_slots=1, slot_bytes=64))
    a, b = shares.client(paths), shares.client(paths)
    a.complete_store(a.prepare_store([K(1)]).keys, success=True)
    assert a.readable_prefix([K(1)]) == 1  # the hit this engine's lookup offered
    b.complete_store(b.prepare_store([K(2)]).keys, success=True)  # evicts K(1)
    assert a.readable_prefix([K(1)]) == 0
    assert a.try_prepare_load([K(1)]) is None
    with pytest.raises(ContractViolation):
        a.prepare_load([K(1)])
    assert a.pinned_count == 0 and b.pins_of(K(2)) == 0
    a.check_integrity()
