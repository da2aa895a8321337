"""The Redis/Valkey tier against a real redis-server: values, integrity, the index,
and a server that is down, killed, restarted or slow."""

from __future__ import annotations

import threading
import time

import pytest
import redis

from kvoffload.core.failures import MISSING, integrity_failure
from kvoffload.core.keys import ChunkKey
from kvoffload.testing.redis_server import RedisServer
from kvoffload.tiers.redis_client import RedisSettings, key_name, make_client
from kvoffload.tiers.redis_index import RedisIndex
from kvoffload.tiers.redis_store import RedisStore
from kvoffload.tiers.remote_index import RemoteIndexOptions

DIGEST = bytes(range(16))
PAYLOAD = 4096


def K(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def data(i: int) -> bytes:
    return bytes((i * 13 + j) % 256 for j in range(PAYLOAD))


def store(server: RedisServer, rank: int = 0, timeout_ms: int = 1000) -> RedisStore:
    client = make_client(RedisSettings(server.url, timeout_ms=timeout_ms))
    return RedisStore(client, DIGEST, rank, PAYLOAD)


def wait_known(index: RedisIndex, keys: list[ChunkKey]) -> int:
    """Ask until the index can tell (its query thread answers within milliseconds)."""
    deadline = time.monotonic() + 10
    while (run := index.present_run(keys)) is None:
        assert time.monotonic() < deadline, "the index never answered"
        time.sleep(0.005)
    return run


def test_values_round_trip_under_namespaced_keys(redis_server: RedisServer) -> None:
    s = store(redis_server)
    assert s.write_many([(K(1), memoryview(data(1))), (K(2), memoryview(data(2)))]) == [None] * 2
    outs = [bytearray(PAYLOAD), bytearray(PAYLOAD), bytearray(PAYLOAD)]
    failures = s.read_many([K(1), K(2), K(3)], (), [memoryview(o) for o in outs])
    assert failures == [None, None, MISSING]
    assert bytes(outs[0]) == data(1) and bytes(outs[1]) == data(2)
    names = sorted(n.decode() for n in redis_server.client().keys("*"))
    assert names == sorted([key_name(DIGEST, K(1), 0), key_name(DIGEST, K(2), 0)])
    assert all(n.startswith(f"kvoffload:v1:{DIGEST.hex()}:") for n in names)


def test_a_garbage_value_is_a_counted_miss_and_is_deleted(redis_server: RedisServer) -> None:
    s = store(redis_server)
    s.write_many([(K(1), memoryview(data(1)))])
    raw = redis_server.client()
    raw.set(s.name(K(1)), b"garbage" * 100)
    failures = s.read_many([K(1)], (), [memoryview(bytearray(PAYLOAD))])
    assert failures == [integrity_failure("size")]
    assert raw.exists(s.name(K(1))) == 0
    s.write_many([(K(1), memoryview(data(1)))])
    raw.set(s.name(K(1)), bytes(len(raw.get(s.name(K(1))))))  # right length, all zeros
    assert s.read_many([K(1)], (), [memoryview(bytearray(PAYLOAD))]) == [integrity_failure("magic")]
    assert raw.exists(s.name(K(1))) == 0
    raw.rpush(s.name(K(1)), b"a list")  # another type under a chunk's name (deleted above)
    assert s.read_many([K(1)], (), [memoryview(bytearray(PAYLOAD))]) == [integrity_failure("magic")]
    assert raw.exists(s.name(K(1))) == 0
    s.write_many([(K(2), memoryview(data(2)))])
    value = bytearray(raw.get(s.name(K(2))))
    value[-1] ^= 1
    raw.set(s.name(K(2)), bytes(value))
    assert s.read_many([K(2)], (), [memoryview(bytearray(PAYLOAD))]) == [
        integrity_failure("checksum")
    ]


def test_ranks_and_namespaces_never_read_each_other(redis_server: RedisServer) -> None:
    rank0, rank1 = store(redis_server, 0), store(redis_server, 1)
    rank0.write_many([(K(1), memoryview(data(1)))])
    raw = redis_server.client()
    raw.set(rank1.name(K(1)), raw.get(rank0.name(K(1))))  # rank 0's value under rank 1's name
    assert rank1.read_many([K(1)], (), [memoryview(bytearray(PAYLOAD))]) == [
        integrity_failure("key")
    ]
    other = RedisStore(rank0.client, bytes(16), 0, PAYLOAD)
    raw.set(other.name(K(1)), raw.get(rank0.name(K(1))))
    assert other.read_many([K(1)], (), [memoryview(bytearray(PAYLOAD))]) == [
        integrity_failure("format")
    ]


def test_the_index_asks_the_server_and_needs_every_rank(redis_server: RedisServer) -> None:
    client = make_client(RedisSettings(redis_server.url))
    index = RedisIndex(client, DIGEST, world_size=2)
    try:
        store(redis_server, 0).write_many([(K(i), memoryview(data(i))) for i in range(3)])
        store(redis_server, 1).write_many([(K(i), memoryview(data(i))) for i in range(2)])
        # Asked in the lookup, one round trip; K(2) lacks rank 1's share.
        assert index.present_run([K(0), K(1), K(2)]) == 2
        assert index.metrics.value("probes_total") == 1
        assert index.metrics.value("lookup_deferrals_total") == 0
        booking = index.book_spill([K(0), K(5)])
        assert booking is not None and booking.keys == (K(5),)  # K(0) is known present
    finally:
        index.close()


def test_the_index_in_background_mode_answers_on_its_thread(redis_server: RedisServer) -> None:
    client = make_client(RedisSettings(redis_server.url))
    index = RedisIndex(client, DIGEST, world_size=1, options=RemoteIndexOptions(probe="async"))
    try:
        store(redis_server).write_many([(K(1), memoryview(data(1)))])
        assert index.present_run([K(1)]) is None  # asked, not known yet
        assert wait_known(index, [K(1)]) == 1
        assert index.metrics.value("lookup_deferrals_total") >= 1
    finally:
        index.close()


def test_a_server_that_is_down_killed_or_restarted_never_blocks(
    redis_server: RedisServer,
) -> None:
    client = make_client(RedisSettings(redis_server.url, timeout_ms=200))
    # A generous budget: the probes stay in the lookup even on a fresh connection.
    options = RemoteIndexOptions(retry_s=0.2, sync_probe_s=1.0)
    index = RedisIndex(client, DIGEST, world_size=1, options=options)
    s = store(redis_server, timeout_ms=200)
    try:
        s.write_many([(K(1), memoryview(data(1)))])
        assert wait_known(index, [K(1)]) == 1
        redis_server.kill()
        with pytest.raises(redis.ConnectionError):
            s.read_many([K(1)], (), [memoryview(bytearray(PAYLOAD))])
        # An unknown key: the probe in the lookup fails, a miss; the index backs off.
        assert index.present_run([K(7)]) == 0 and index.query_errors == 1
        assert index.present_run([K(8), K(9)]) == 0  # down: answered at once, no query
        assert index.query_errors == 1
        redis_server.restart()  # back, empty
        time.sleep(0.25)  # past the back-off: probed in the background until one answers
        deadline = time.monotonic() + 10
        while wait_known(index, [K(1)]) != 0:  # K(1)'s answer lapses; asked: gone
            assert time.monotonic() < deadline
            time.sleep(0.05)
        probes = index.metrics.value("probes_total")
        assert index.present_run([K(10)]) == 0  # asked in the lookup again
        assert index.metrics.value("probes_total") == probes + 1
        assert s.write_many([(K(1), memoryview(data(1)))]) == [None]
    finally:
        index.close()


def test_a_slow_server_times_out_instead_of_stalling(redis_server: RedisServer) -> None:
    s = store(redis_server, timeout_ms=150)
    s.write_many([(K(1), memoryview(data(1)))])
    sleeper = threading.Thread(
        target=lambda: redis_server.client().execute_command("DEBUG", "SLEEP", 1)
    )
    sleeper.start()
    time.sleep(0.05)  # let DEBUG SLEEP reach the server first
    begin = time.monotonic()
    with pytest.raises(redis.TimeoutError):
        s.read_many([K(1)], (), [memoryview(bytearray(PAYLOAD))])
    assert time.monotonic() - begin < 0.9
    sleeper.join()


@pytest.mark.parametrize("zero_copy", [True, False], ids=["kvoffload-reader", "redis-py"])
@pytest.mark.parametrize("protocol", [2, 3])
def test_one_connection_stays_in_step_over_mixed_replies(
    redis_server: RedisServer, protocol: int, zero_copy: bool
) -> None:
    """Good, missing, short and wrongly typed values in one pipelined read, on a pool
    of one connection: every later read on it still gets its own replies. Both read
    paths (kvoffload's reply reader; redis-py's, used with the cluster client) agree."""
    client = redis.Redis(
        connection_pool=redis.BlockingConnectionPool.from_url(
            redis_server.url, max_connections=1, protocol=protocol
        )
    )
    s = RedisStore(client, DIGEST, 0, PAYLOAD)
    assert s.zero_copy  # a single-node client takes kvoffload's own path by default
    s.zero_copy = zero_copy
    s.write_many([(K(i), memoryview(data(i))) for i in range(1, 5)])
    raw = redis_server.client()
    raw.set(s.name(K(2)), b"short")
    raw.delete(s.name(K(3)), s.name(K(4)))
    raw.sadd(s.name(K(4)), b"a set")
    outs = [memoryview(bytearray(PAYLOAD)) for _ in range(5)]
    keys = [K(1), K(2), K(3), K(4), K(1)]
    assert s.read_many(keys, (), outs) == [
        None,
        integrity_failure("size"),
        MISSING,
        integrity_failure("magic"),
        None,
    ]
    assert bytes(outs[0]) == data(1) == bytes(outs[4])
    for _ in range(3):
        s.write_many([(K(5), memoryview(data(5)))])
        out = memoryview(bytearray(PAYLOAD))
        assert s.read_many([K(5)], (), [out]) == [None]
        assert bytes(out) == data(5)


def test_a_read_cut_off_mid_value_raises_a_connection_error(redis_server: RedisServer) -> None:
    s = store(redis_server, timeout_ms=300)
    s.write_many([(K(1), memoryview(data(1)))])
    redis_server.client().client_pause(2000)  # the server stops answering
    with pytest.raises(redis.RedisError):
        s.read_many([K(1)], (), [memoryview(bytearray(PAYLOAD))])
    redis_server.client().client_unpause()
    out = memoryview(bytearray(PAYLOAD))
    assert s.read_many([K(1)], (), [out]) == [None]  # a fresh connection, same answers
    assert bytes(out) == data(1)


def test_variable_size_values_are_stored_at_their_size_and_checked(
    redis_server: RedisServer,
) -> None:
    """A store for a variable-size codec (lossless, decision 0023) keeps each value at
    its own length, reads it into the front of a full buffer, and still refuses a
    value longer than the most a chunk holds or with a bad checksum."""
    client = make_client(RedisSettings(redis_server.url, timeout_ms=1000))
    s = RedisStore(client, DIGEST, 0, PAYLOAD, variable=True)
    short = data(3)[:1000]
    assert s.write_many([(K(1), memoryview(short)), (K(2), memoryview(data(2)))]) == [None] * 2
    assert redis_server.client().strlen(key_name(DIGEST, K(1), 0)) == 64 + 1000
    for zero_copy in (True, False):
        s.zero_copy = zero_copy
        outs = [bytearray(PAYLOAD), bytearray(PAYLOAD)]
        assert s.read_many([K(1), K(2)], (), [memoryview(o) for o in outs]) == [None, None]
        assert bytes(outs[0][:1000]) == short and bytes(outs[1]) == data(2)
    fixed = store(redis_server)  # a fixed-size store refuses the short value
    (failure,) = fixed.read_many([K(1)], (), [memoryview(bytearray(PAYLOAD))])
    assert failure is not None and str(failure) == "integrity:size"
    raw = redis_server.client()
    name = key_name(DIGEST, K(2), 0)
    value = bytearray(raw.get(name))
    value[100] ^= 1
    raw.set(name, bytes(value))
    (failure,) = s.read_many([K(2)], (), [memoryview(bytearray(PAYLOAD))])
    assert failure == integrity_failure("checksum")
    for zero_copy in (True, False):  # longer than a chunk holds
        s.zero_copy = zero_copy
        s.write_many([(K(3), memoryview(data(3) + b"extra"))])
        (failure,) = s.read_many([K(3)], (), [memoryview(bytearray(PAYLOAD))])
        assert failure is not None and str(failure) in ("integrity:size", "integrity:length")
