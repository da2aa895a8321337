"""The host directory's contract (:class:`~kvoffload.core.directory.HostDirectory`),
run over every implementation (``directory_envs.py``: ids ``engine``, ``share``,
``sim``) and every eviction policy. A test of one implementation's own says why."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from directory_envs import IMPLEMENTATIONS, MakeDirectory, directories

from kvoffload.core.chunk_state import ChunkState
from kvoffload.core.directory import Directory, HostDirectory, LookupStatus
from kvoffload.core.errors import ConfigError, ContractViolation, IllegalTransition
from kvoffload.core.keys import ChunkKey
from kvoffload.core.observe.events import CacheEvent, EventKind
from kvoffload.core.policies import policy_names

HIT, MISS, PENDING = LookupStatus.HIT, LookupStatus.MISS, LookupStatus.HIT_PENDING


def K(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


@pytest.fixture(params=policy_names())
def policy(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=IMPLEMENTATIONS)
def make(request: pytest.FixtureRequest) -> Iterator[MakeDirectory]:
    """Fresh directories of one implementation, released after the test."""
    with directories(str(request.param)) as factory:
        yield factory


def stored(d: HostDirectory, keys: list[ChunkKey]) -> None:
    prep = d.prepare_store(keys)
    d.complete_store(prep.keys, success=True)


def snapshot(d: HostDirectory, keys: list[ChunkKey]) -> tuple[object, ...]:
    return (d.lookup(keys), d.used_slots, d.evictable_count, [d.pins_of(k) for k in keys])


def test_lookup_reports_hit_pending_miss_and_the_readable_prefix(
    make: MakeDirectory, policy: str
) -> None:
    d = make(8, policy=policy)
    stored(d, [K(0), K(1)])
    d.prepare_store([K(2)])
    result = d.lookup([K(0), K(1), K(2), K(3), K(4)])
    assert result.statuses == (HIT, HIT, PENDING, MISS, MISS)
    assert result.readable_prefix == 2
    assert d.readable_prefix([K(0), K(1), K(2)]) == 2
    assert d.lookup([K(9), K(0)]).readable_prefix == 0
    assert d.lookup([]).readable_prefix == 0


def test_lookup_has_no_side_effects(make: MakeDirectory, policy: str) -> None:
    d = make(2, policy=policy)
    stored(d, [K(0)])
    stored(d, [K(1)])
    for _ in range(5):
        d.lookup([K(0)])  # if lookup touched, K(0) would survive the eviction below
    assert d.prepare_store([K(2)]).evicted == (K(0),)


def test_prepare_store_skips_present_keys_and_duplicates(make: MakeDirectory, policy: str) -> None:
    d = make(8, policy=policy)
    stored(d, [K(0)])
    d.prepare_store([K(1)])
    prep = d.prepare_store([K(0), K(1), K(2), K(2), K(3)])
    assert prep.keys == (K(2), K(3)) and len(set(prep.slots)) == 2
    assert not prep.no_room and prep.evicted == ()


def test_stored_chunks_become_readable_and_failed_ones_vanish(
    make: MakeDirectory, policy: str
) -> None:
    d = make(4, policy=policy)
    a = d.prepare_store([K(0), K(1)])
    b = d.prepare_store([K(2)])
    d.complete_store(a.keys, success=True)
    d.complete_store(b.keys, success=False)
    assert d.lookup([K(0), K(1), K(2)]).statuses == (HIT, HIT, MISS)
    assert d.used_slots == 2
    events = d.take_events()
    assert events == [CacheEvent(EventKind.STORED, (K(0), K(1)), "host")]
    assert d.take_events() == []
    d.check_integrity()


def test_the_tail_of_a_prefix_is_evicted_before_its_head(make: MakeDirectory, policy: str) -> None:
    d = make(3, policy=policy)
    stored(d, [K(0), K(1), K(2)])
    assert d.prepare_store([K(9)]).evicted == (K(2),)
    d.touch([K(0), K(1)])
    assert d.prepare_store([K(8)]).evicted == (K(1),)


def test_pinned_and_storing_chunks_are_never_evicted(make: MakeDirectory, policy: str) -> None:
    d = make(4, policy=policy)
    stored(d, [K(0), K(1), K(2)])
    d.prepare_load([K(0), K(1)])
    d.prepare_store([K(3)])  # STORING, fills the last slot
    prep = d.prepare_store([K(4)])
    assert prep.evicted == (K(2),)
    assert d.prepare_store([K(5)]).no_room  # only pinned/storing chunks are left
    assert d.lookup([K(0), K(1), K(3)]).statuses == (HIT, HIT, PENDING)
    d.check_integrity()


def test_eviction_is_all_or_nothing(make: MakeDirectory, policy: str) -> None:
    d = make(4, policy=policy)
    keys = [K(i) for i in range(4)]
    stored(d, keys)
    d.prepare_load([K(0), K(1)])
    d.take_events()
    before = snapshot(d, keys)
    prep = d.prepare_store([K(10), K(11), K(12)])  # needs 3 victims, only 2 evictable
    assert prep.no_room and prep.keys == () and prep.evicted == ()
    assert snapshot(d, keys) == before and d.take_events() == []
    assert d.metrics.value("no_room_total") == 1
    d.check_integrity()


def test_keys_of_the_same_batch_are_not_evicted_to_make_room_for_it(
    make: MakeDirectory, policy: str
) -> None:
    d = make(2, policy=policy)
    stored(d, [K(0), K(1)])
    # K(0) is the head of the batch: evicting it to store K(2) would be self-defeating.
    prep = d.prepare_store([K(0), K(2)])
    assert prep.keys == (K(2),) and prep.evicted == (K(1),)
    assert d.prepare_store([K(0), K(1), K(3)]).no_room


def test_eviction_emits_removed_events_with_the_tier(make: MakeDirectory, policy: str) -> None:
    d = make(1, tier="disk", policy=policy)
    stored(d, [K(0)])
    d.take_events()
    d.complete_store(d.prepare_store([K(1)]).keys, success=True)
    assert d.take_events() == [
        CacheEvent(EventKind.REMOVED, (K(0),), "disk"),
        CacheEvent(EventKind.STORED, (K(1),), "disk"),
    ]


def test_load_pins_are_counted_and_released(make: MakeDirectory, policy: str) -> None:
    d = make(2, policy=policy)
    stored(d, [K(0), K(1)])
    slots = d.prepare_load([K(0)])
    assert slots == (d.slot_of(K(0)),)
    d.prepare_load([K(0)])
    assert d.pins_of(K(0)) == 2 and d.state_of(K(0)) is ChunkState.PINNED
    d.complete_load([K(0)])
    assert d.prepare_store([K(5)]).evicted == (K(1),)  # K(0) is still pinned once
    d.complete_load([K(0)])
    assert d.pins_of(K(0)) == 0 and d.state_of(K(0)) is ChunkState.READY
    assert d.pinned_count == 0
    d.check_integrity()


def test_admission_counts_lookups_and_bounds_its_memory(make: MakeDirectory, policy: str) -> None:
    d = make(8, policy=policy, store_threshold=2, max_admission_counters=3)
    assert d.prepare_store([K(0)]).refused == (K(0),)
    d.record_lookups([K(0)])
    assert d.prepare_store([K(0)]).refused == (K(0),)
    d.record_lookups([K(0)])
    assert d.prepare_store([K(0)]).keys == (K(0),)
    d.record_lookups([K(1)])
    d.record_lookups([K(2), K(3), K(4)])  # K(1)'s counter is pushed out (bound 3)
    d.record_lookups([K(1)])
    assert d.prepare_store([K(1)]).refused == (K(1),)
    assert d.metrics.value("admission_refusals_total") == 3
    d.check_integrity()


def test_contract_violations_raise_and_change_nothing(make: MakeDirectory, policy: str) -> None:
    d = make(4, policy=policy)
    stored(d, [K(0)])
    d.prepare_store([K(1)])
    before = snapshot(d, [K(0), K(1), K(2)])
    with pytest.raises(ContractViolation):
        d.prepare_load([K(0), K(2)])  # K(2) is a miss
    with pytest.raises(ContractViolation):
        d.prepare_load([K(1)])  # pending, not readable
    with pytest.raises(ContractViolation):
        d.complete_load([K(0)])  # not pinned
    with pytest.raises(ContractViolation):
        d.complete_store([K(0)], success=True)  # already READY
    with pytest.raises(ContractViolation):
        d.complete_store([K(1), K(1)], success=True)
    assert snapshot(d, [K(0), K(1), K(2)]) == before
    d.check_integrity()


def test_discard_while_pinned_or_storing_frees_when_the_job_completes(
    make: MakeDirectory, policy: str
) -> None:
    d = make(4, policy=policy)
    stored(d, [K(0), K(1)])
    d.prepare_load([K(0)])
    d.prepare_store([K(2)])
    d.take_events()
    assert d.discard([K(0), K(1), K(2), K(7)]) == [K(0), K(1)]
    assert d.take_events() == [CacheEvent(EventKind.REMOVED, (K(0), K(1)), "host")]
    assert d.lookup([K(0), K(1), K(2)]).statuses == (MISS, MISS, MISS)
    assert d.used_slots == 2  # the pinned and the storing slot are still in use
    d.check_integrity()
    # Not stored again while the old copy is in flight: completions stay unambiguous.
    assert d.prepare_store([K(0), K(2), K(3)]).keys == (K(3),)
    d.complete_load([K(0)])
    d.complete_store([K(2)], success=True)  # completes into nothing
    assert d.lookup([K(0), K(2), K(3)]).statuses == (MISS, MISS, PENDING)
    assert d.used_slots == 1 and d.pinned_count == 0
    d.check_integrity()
    stored(d, [K(0)])  # once released, the key can be stored again
    assert d.lookup([K(0)]).statuses == (HIT,)
    d.check_integrity()


def test_reset_forgets_everything_but_keeps_in_flight_slots_safe(
    make: MakeDirectory, policy: str
) -> None:
    d = make(4, policy=policy, store_threshold=2)
    d.record_lookups([K(0), K(1), K(2), K(5)])
    d.record_lookups([K(0), K(1), K(2), K(5)])
    stored(d, [K(0), K(1)])
    d.prepare_load([K(0)])
    d.prepare_store([K(2)])
    d.reset()
    assert len(d) == 0 and d.used_slots == 2
    assert d.prepare_store([K(5)]).refused == (K(5),)  # admission counters were reset
    d.complete_load([K(0)])
    d.complete_store([K(2)], success=True)
    assert d.used_slots == 0 and d.free_slots == 4
    d.check_integrity()


def test_illegal_transitions_raise() -> None:  # the state table's, no directory
    from kvoffload.core.chunk_state import check_transition

    check_transition(ChunkState.STORING, ChunkState.READY)
    for current, target in [
        (ChunkState.FREE, ChunkState.READY),
        (ChunkState.STORING, ChunkState.PINNED),
        (ChunkState.READY, ChunkState.STORING),
        (ChunkState.FREE, ChunkState.PINNED),
    ]:
        with pytest.raises(IllegalTransition):
            check_transition(current, target)


def test_integrity_check_catches_corruption() -> None:  # engine: corrupts its slot table
    d = Directory(4)
    stored(d, [K(0)])
    d.check_integrity()
    d._slots.evictable += 1  # simulate a bookkeeping bug
    with pytest.raises(ContractViolation, match="evictable"):
        d.check_integrity()


def test_bad_configuration_names_the_field(make: MakeDirectory) -> None:
    with pytest.raises(ConfigError, match="num_slots"):
        make(0)
    with pytest.raises(ConfigError, match="store_threshold"):
        make(4, store_threshold=0)
    with pytest.raises(ConfigError, match="eviction.*valid"):
        make(4, policy="mru")


# engine: ``restore`` is the engine directory's own (a disk tier adopts its files); a
# share starts empty and the simulator never restores.
def test_restore_adopts_chunks_in_their_slots_oldest_first(policy: str) -> None:
    d = Directory(4, tier="disk", policy=policy)
    d.restore([(K(7), 3), (K(8), 0)])
    assert d.slot_of(K(7)) == 3 and d.slot_of(K(8)) == 0
    assert d.lookup([K(7), K(8)]).readable_prefix == 2 and d.evictable_count == 2
    assert d.take_events() == [CacheEvent(EventKind.STORED, (K(7), K(8)), "disk")]
    prepared = d.prepare_store([K(1), K(2)])
    assert sorted(prepared.slots) == [1, 2]  # the free slots, none of the restored ones
    d.check_integrity()
    with pytest.raises(ContractViolation):
        d.restore([(K(9), 1)])  # only into an empty directory
    for bad in ([(K(1), 0), (K(2), 0)], [(K(1), 0), (K(1), 1)], [(K(1), 4)]):
        with pytest.raises(ContractViolation):
            Directory(4, policy=policy).restore(bad)
