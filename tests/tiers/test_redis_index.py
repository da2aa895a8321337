"""The Redis index's answers against a fake client on a fake clock (no server, no
sleeps): what it remembers, when it probes, in the lookup or in the background, and
what it answers while the server is down or slow. The same index against a real
server is in test_redis_tier.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import redis

from kvoffload.core.keys import ChunkKey
from kvoffload.core.observe.events import EventKind
from kvoffload.tiers import redis_index
from kvoffload.tiers.redis_client import key_name
from kvoffload.tiers.redis_index import PROBE, RedisIndex

DIGEST = bytes(range(16))


def K(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeClient:
    """Holds ``held`` value names; each pipeline ``execute`` takes ``latency`` seconds
    of the fake clock, raises ``error`` when set, and runs ``during`` first (a caller
    acting while the probe is on the wire)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.held: set[str] = set()
        self.latency = 0.0001
        self.error: Exception | None = None
        self.during: Callable[[], None] | None = None
        self.probes: list[list[str]] = []  # the value names each probe asked about
        self.commands: list[list[tuple[str, ...]]] = []  # and its EXISTS commands

    def hold(self, *keys: ChunkKey, ranks: int = 1) -> None:
        self.held.update(key_name(DIGEST, k, r) for k in keys for r in range(ranks))

    def pipeline(self, transaction: bool = False) -> FakePipeline:
        assert not transaction
        return FakePipeline(self)


class FakePipeline:
    def __init__(self, client: FakeClient) -> None:
        self.client = client
        self.commands: list[tuple[str, ...]] = []

    def exists(self, *names: str) -> None:
        self.commands.append(names)

    def execute(self) -> list[int]:
        c = self.client
        c.probes.append([n for names in self.commands for n in names])
        c.commands.append(self.commands)
        if c.during is not None:
            during, c.during = c.during, None
            during()
        c.clock.now += c.latency
        if c.error is not None:
            raise c.error
        return [sum(n in c.held for n in names) for names in self.commands]  # EXISTS counts


def make(world_size: int = 1, probe: str = "sync") -> tuple[RedisIndex, FakeClient, Clock]:
    clock = Clock()
    client = FakeClient(clock)
    mode: Any = probe
    index = RedisIndex(client, DIGEST, world_size, probe=mode, clock=clock, background=False)
    return index, client, clock


def counts(index: RedisIndex) -> tuple[int, int, int]:
    m = index.metrics
    return (
        m.value("probes_total"),
        m.value("probed_keys_total"),
        m.value("lookup_deferrals_total"),
    )


def test_the_counters_are_declared_at_zero() -> None:
    index, _, _ = make()
    assert counts(index) == (0, 0, 0)
    names = {name for name, _ in index.metrics.recorder.counters}
    assert {"probes_total", "probed_keys_total", "lookup_deferrals_total"} <= names


def test_own_spills_are_present_at_once_and_stay_so() -> None:
    index, client, clock = make()
    index.complete_spill([K(1), K(2)], [K(3)])
    assert index.present_run([K(1), K(2)]) == 2
    clock.now += 1000 * index.ttl_s  # long past any probe answer's life
    assert index.present_run([K(1), K(2)]) == 2
    assert client.probes == [] and counts(index) == (0, 0, 0)
    booking = index.book_spill([K(1), K(4)])
    assert booking is not None and booking.keys == (K(4),)  # never spilled twice
    assert index.held_count() == 2


def test_a_read_that_misses_forgets_one_that_finds_keeps() -> None:
    index, client, clock = make()
    index.complete_spill([K(1), K(2)], [])
    index.release_promotion([K(1), K(2)], bad=[K(2)])
    assert index.take_events()[-1].kind is EventKind.REMOVED
    assert index.present_run([K(1), K(2)]) == 1  # K(2) absent, without asking
    assert client.probes == []
    clock.now += index.ttl_s  # the miss is forgotten: K(2) is asked about again
    client.hold(K(2))  # another engine stored it meanwhile
    assert index.present_run([K(1), K(2)]) == 2 and len(client.probes) == 1
    index.release_promotion([K(2)], bad=[])  # read back good: known from now on
    clock.now += 1000 * index.ttl_s
    assert index.present_run([K(1), K(2)]) == 2 and len(client.probes) == 1


def test_entries_pushed_out_of_the_bounded_cache_are_asked_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(redis_index, "MAX_CACHED", 2)
    index, client, _ = make()
    client.hold(K(1))
    index.complete_spill([K(1), K(2), K(3)], [])  # K(1) pushed out
    assert index.present_run([K(2), K(3)]) == 2 and client.probes == []
    assert index.present_run([K(1)]) == 1 and len(client.probes) == 1


def test_a_reset_forgets_every_chunk() -> None:
    index, client, _ = make()
    index.complete_spill([K(1)], [])
    index.reset()
    assert index.present_run([K(1)]) == 0 and len(client.probes) == 1


def test_unknown_keys_are_probed_in_the_lookup_on_a_healthy_server() -> None:
    index, client, clock = make(world_size=2)
    client.hold(K(1), K(2), ranks=2)
    client.hold(K(3), ranks=1)  # rank 1's share is missing: not present
    keys = [K(1), K(2), K(3), K(4)]
    assert index.present_run(keys) == 2  # answered in the call, never None
    assert counts(index) == (1, 4, 0)
    assert client.commands[0] == [tuple(key_name(DIGEST, k, r) for r in (0, 1)) for k in keys]
    assert index.present_run(keys) == 2 and counts(index) == (1, 4, 0)  # cached
    clock.now += index.ttl_s + 1  # probe answers live ttl_s (other engines' chunks)
    assert index.present_run(keys) == 2 and counts(index) == (2, 8, 0)


def test_a_probe_asks_the_unknown_keys_from_the_first_one_up_to_a_known_miss() -> None:
    index, client, _ = make()
    index.complete_spill([K(0), K(2)], [])
    index.release_promotion([K(5)], bad=[K(5)])  # known absent
    client.hold(K(1), K(3), K(4))
    assert index.present_run([K(i) for i in range(8)]) == 5
    assert client.probes == [[key_name(DIGEST, K(i), 0) for i in (1, 3, 4)]]
    many = [K(100 + i) for i in range(PROBE + 10)]
    client.hold(*many)
    assert index.present_run(many) == PROBE  # one round trip: the rest asked next time
    assert len(client.probes[-1]) == PROBE
    assert index.present_run(many) == len(many) and len(client.probes[-1]) == 10


def test_a_server_that_is_down_answers_absent_without_deferring_or_raising() -> None:
    index, client, clock = make()
    index.complete_spill([K(9)], [])
    client.error = redis.ConnectionError("refused")
    assert index.present_run([K(1)]) == 0
    assert index.query_errors == 1 and counts(index) == (1, 1, 0)
    assert index.present_run([K(2)]) == 0 and index.present_run([K(9)]) == 0  # backing off
    assert len(client.probes) == 1 and counts(index) == (1, 1, 0)
    client.error = RuntimeError("any error")  # whatever a client raises: a miss
    clock.now += index.retry_s + 1
    assert index.present_run([K(2)]) is None  # after the back-off: probed in background
    index.pump()
    assert index.query_errors == 2 and index.present_run([K(2)]) == 0
    assert counts(index) == (2, 2, 1)
    client.error = None
    client.hold(K(2))
    clock.now += index.retry_s + 1
    assert index.present_run([K(2)]) is None
    index.pump()  # the server answers: lookups probe in the call again
    assert index.present_run([K(2), K(9)]) == 2
    assert index.present_run([K(3)]) == 0 and counts(index) == (4, 4, 2)


def test_a_slow_probe_sends_the_next_ones_to_the_background_for_a_while() -> None:
    index, client, clock = make()
    client.hold(K(1), K(2))
    client.latency = 10 * index.sync_probe_s
    assert index.present_run([K(1)]) == 1  # slow, but answered
    assert index.present_run([K(2)]) is None  # queued: an answer will come
    assert counts(index) == (1, 1, 1)
    index.pump()
    assert index.present_run([K(2)]) == 1 and counts(index) == (2, 2, 1)
    client.latency = 0.0001
    clock.now += index.retry_s
    assert index.present_run([K(3)]) == 0 and counts(index) == (3, 3, 1)  # in the call


def test_async_probing_defers_until_pumped_and_asks_each_key_once() -> None:
    index, client, _ = make(probe="async")
    client.hold(K(1))
    assert index.present_run([K(1)]) is None and client.probes == []
    again: list[int | None] = []
    client.during = lambda: again.append(index.present_run([K(1)]))  # asked while in flight
    index.pump()
    assert again == [None] and len(client.probes) == 1  # not queued a second time
    assert index.present_run([K(1)]) == 1 and counts(index) == (1, 1, 2)


def test_an_answer_overtaken_by_a_reset_is_dropped() -> None:
    index, client, _ = make()
    client.hold(K(1))
    client.during = index.reset
    assert index.present_run([K(1)]) == 0  # the answer was for keys of the old epoch
    client.during = None
    assert index.present_run([K(1)]) == 1 and len(client.probes) == 2


def test_a_closed_index_never_defers() -> None:
    index, client, _ = make(probe="async")
    index.close()
    index.complete_spill([K(1)], [])
    assert index.present_run([K(1), K(2)]) == 1 and client.probes == []
    assert counts(index) == (0, 0, 0)


def test_an_unknown_probe_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="probe"):
        make(probe="lazy")
