"""The remote index's answers against a fake store on a fake clock (no server, no
sleeps): what it remembers, when it probes, in the lookup or in the background, and
what it answers while the store is down or slow. How the Redis index asks a server
is in test_redis_index.py; the Redis index against a real server in
test_redis_tier.py."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from kvoffload.core.keys import ChunkKey
from kvoffload.core.observe.events import EventKind
from kvoffload.tiers import remote_index
from kvoffload.tiers.remote_index import PROBE, RemoteIndex, RemoteIndexOptions


def K(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class FakeStore:
    """An :class:`~kvoffload.tiers.remote_index.ExistenceQuery` holding ``held``
    chunks; each probe takes ``latency`` seconds of the fake clock, raises ``error``
    when set, and runs ``during`` first (a caller acting while the probe is on the
    wire)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.held: set[ChunkKey] = set()
        self.latency = 0.0001
        self.error: Exception | None = None
        self.during: Callable[[], None] | None = None
        self.probes: list[list[ChunkKey]] = []  # the keys each probe asked about

    def hold(self, *keys: ChunkKey) -> None:
        self.held.update(keys)

    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        self.probes.append(list(keys))
        if self.during is not None:
            during, self.during = self.during, None
            during()
        self.clock.now += self.latency
        if self.error is not None:
            raise self.error
        return [k in self.held for k in keys]


def make(probe: str = "sync") -> tuple[RemoteIndex, FakeStore, Clock]:
    clock = Clock()
    store = FakeStore(clock)
    mode: Any = probe
    options = RemoteIndexOptions(probe=mode, clock=clock, background=False)
    return RemoteIndex("remote", store, options), store, clock


def counts(index: RemoteIndex) -> tuple[int, int, int]:
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
    index, store, clock = make()
    index.complete_spill([K(1), K(2)], [K(3)])
    assert index.present_run([K(1), K(2)]) == 2
    clock.now += 1000 * index.options.ttl_s  # long past any probe answer's life
    assert index.present_run([K(1), K(2)]) == 2
    assert store.probes == [] and counts(index) == (0, 0, 0)
    booking = index.book_spill([K(1), K(4)])
    assert booking is not None and booking.keys == (K(4),)  # never spilled twice
    assert index.held_count() == 2


def test_a_read_that_misses_forgets_one_that_finds_keeps() -> None:
    index, store, clock = make()
    index.complete_spill([K(1), K(2)], [])
    index.release_promotion([K(1), K(2)], bad=[K(2)])
    assert index.take_events()[-1].kind is EventKind.REMOVED
    assert index.present_run([K(1), K(2)]) == 1  # K(2) absent, without asking
    assert store.probes == []
    clock.now += index.options.ttl_s  # the miss is forgotten: K(2) is asked about again
    store.hold(K(2))  # another engine stored it meanwhile
    assert index.present_run([K(1), K(2)]) == 2 and len(store.probes) == 1
    index.release_promotion([K(2)], bad=[])  # read back good: known from now on
    clock.now += 1000 * index.options.ttl_s
    assert index.present_run([K(1), K(2)]) == 2 and len(store.probes) == 1


def test_entries_pushed_out_of_the_bounded_cache_are_asked_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(remote_index, "MAX_CACHED", 2)
    index, store, _ = make()
    store.hold(K(1))
    index.complete_spill([K(1), K(2), K(3)], [])  # K(1) pushed out
    assert index.present_run([K(2), K(3)]) == 2 and store.probes == []
    assert index.present_run([K(1)]) == 1 and len(store.probes) == 1


def test_a_reset_forgets_every_chunk() -> None:
    index, store, _ = make()
    index.complete_spill([K(1)], [])
    index.reset()
    assert index.present_run([K(1)]) == 0 and len(store.probes) == 1


def test_unknown_keys_are_probed_in_the_lookup_on_a_healthy_store() -> None:
    index, store, clock = make()
    store.hold(K(1), K(2))
    keys = [K(1), K(2), K(3), K(4)]
    assert index.present_run(keys) == 2  # answered in the call, never None
    assert counts(index) == (1, 4, 0) and store.probes == [keys]
    assert index.present_run(keys) == 2 and counts(index) == (1, 4, 0)  # cached
    clock.now += index.options.ttl_s + 1  # probe answers live ttl_s (other engines' chunks)
    assert index.present_run(keys) == 2 and counts(index) == (2, 8, 0)


def test_a_probe_asks_the_unknown_keys_from_the_first_one_up_to_a_known_miss() -> None:
    index, store, _ = make()
    index.complete_spill([K(0), K(2)], [])
    index.release_promotion([K(5)], bad=[K(5)])  # known absent
    store.hold(K(1), K(3), K(4))
    assert index.present_run([K(i) for i in range(8)]) == 5
    assert store.probes == [[K(i) for i in (1, 3, 4)]]
    many = [K(100 + i) for i in range(PROBE + 10)]
    store.hold(*many)
    assert index.present_run(many) == PROBE  # one round trip: the rest asked next time
    assert len(store.probes[-1]) == PROBE
    assert index.present_run(many) == len(many) and len(store.probes[-1]) == 10


def test_a_store_that_is_down_answers_absent_without_deferring_or_raising() -> None:
    index, store, clock = make()
    index.complete_spill([K(9)], [])
    store.error = ConnectionError("refused")
    assert index.present_run([K(1)]) == 0
    assert index.query_errors == 1 and counts(index) == (1, 1, 0)
    assert index.present_run([K(2)]) == 0 and index.present_run([K(9)]) == 0  # backing off
    assert len(store.probes) == 1 and counts(index) == (1, 1, 0)
    store.error = RuntimeError("any error")  # whatever a store raises: a miss
    clock.now += index.options.retry_s + 1
    assert index.present_run([K(2)]) is None  # after the back-off: probed in background
    index.pump()
    assert index.query_errors == 2 and index.present_run([K(2)]) == 0
    assert counts(index) == (2, 2, 1)
    store.error = None
    store.hold(K(2))
    clock.now += index.options.retry_s + 1
    assert index.present_run([K(2)]) is None
    index.pump()  # the store answers: lookups probe in the call again
    assert index.present_run([K(2), K(9)]) == 2
    assert index.present_run([K(3)]) == 0 and counts(index) == (4, 4, 2)


def test_a_slow_probe_sends_the_next_ones_to_the_background_for_a_while() -> None:
    index, store, clock = make()
    store.hold(K(1), K(2))
    store.latency = 10 * index.options.sync_probe_s
    assert index.present_run([K(1)]) == 1  # slow, but answered
    assert index.present_run([K(2)]) is None  # queued: an answer will come
    assert counts(index) == (1, 1, 1)
    index.pump()
    assert index.present_run([K(2)]) == 1 and counts(index) == (2, 2, 1)
    store.latency = 0.0001
    clock.now += index.options.retry_s
    assert index.present_run([K(3)]) == 0 and counts(index) == (3, 3, 1)  # in the call


def test_async_probing_defers_until_pumped_and_asks_each_key_once() -> None:
    index, store, _ = make(probe="async")
    store.hold(K(1))
    assert index.present_run([K(1)]) is None and store.probes == []
    again: list[int | None] = []
    store.during = lambda: again.append(index.present_run([K(1)]))  # asked while in flight
    index.pump()
    assert again == [None] and len(store.probes) == 1  # not queued a second time
    assert index.present_run([K(1)]) == 1 and counts(index) == (1, 1, 2)


def test_an_answer_overtaken_by_a_reset_is_dropped() -> None:
    index, store, _ = make()
    store.hold(K(1))
    store.during = index.reset
    assert index.present_run([K(1)]) == 0  # the answer was for keys of the old epoch
    store.during = None
    assert index.present_run([K(1)]) == 1 and len(store.probes) == 2


def test_a_closed_index_never_defers() -> None:
    index, store, _ = make(probe="async")
    index.close()
    index.complete_spill([K(1)], [])
    assert index.present_run([K(1), K(2)]) == 1 and store.probes == []
    assert counts(index) == (0, 0, 0)


def test_an_unknown_probe_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="probe"):
        make(probe="lazy")
