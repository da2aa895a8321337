"""One contract, every lower tier: the scheduler half's index (``LowerTier``:
lookups, spill and promotion bookings, reset) and the worker's store (``TierStore``:
round trips, and a chunk missing, damaged, of another group or under another key is a
failed chunk, never an exception). Every tier of the registry (``tiers/registry.py``)
runs it, built by its own spec."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from tests.contract.tier_envs import PAYLOAD, SEAL_OPTIONS, SETUPS, TierEnv, open_env

from kvoffload.core.config.typed import OffloadConfig
from kvoffload.core.failures import ChunkFailure, FailureKind
from kvoffload.core.keys import ChunkKey
from kvoffload.core.observe.events import EventKind
from kvoffload.core.tiering.lower import LowerTier
from kvoffload.tiers.registry import LOWER_TIERS, lower_tier_names


def K(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def data(i: int) -> bytes:
    return bytes((i * 31 + j) % 251 for j in range(PAYLOAD))


VARIANTS = [(spec, False) for spec in LOWER_TIERS] + [
    (spec, True) for spec in LOWER_TIERS if spec.name in SEAL_OPTIONS
]


@pytest.fixture(
    params=VARIANTS, ids=[s.name + ("-sealed" if sealed else "") for s, sealed in VARIANTS]
)
def env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[TierEnv]:
    spec, sealed = request.param
    with open_env(spec, tmp_path, sealed=sealed) as opened:
        yield opened


def test_every_registered_tier_has_a_contract_setup() -> None:
    assert sorted(SETUPS) == sorted(lower_tier_names())
    # every tier a seal key may seal has its sealed variant here
    sealable = [s.name for s in LOWER_TIERS if s.seals(OffloadConfig.from_dict(
        {"cpu_bytes": 1, "disk_seal": True}))]  # fmt: skip
    assert sorted(SEAL_OPTIONS) == sorted(sealable)


def run(tier: LowerTier, keys: Sequence[ChunkKey]) -> int:
    """``present_run`` until it can tell (a sync index answers in the call)."""
    for _ in range(3):
        answer = tier.present_run(keys)
        if answer is not None:
            return answer
        pump = getattr(tier, "pump", None)
        if pump is not None:
            pump()
    raise AssertionError(f"{tier.name} never answered present_run")


def spill(tier: LowerTier, keys: Sequence[ChunkKey]) -> tuple[int, ...]:
    """Book and complete a spill of every key: their tier slots (empty: keyed by chunk)."""
    booking = tier.book_spill(keys)
    assert booking is not None and booking.keys == tuple(keys) and not booking.later
    tier.complete_spill(booking.keys, [])
    return booking.slots


# ---------------------------------------------------------------- LowerTier


def test_a_new_tier_holds_nothing_and_counts_from_zero(env: TierEnv) -> None:
    tier = env.index
    assert tier.name == env.name
    assert run(tier, [K(1), K(2)]) == 0
    assert not tier.holds(K(1)) and tier.held_count() == 0
    assert tier.metrics.value("transferred_chunks_total", direction="spill") == 0
    assert tier.metrics.value("failed_chunks_total", direction="promote") == 0
    assert tier.take_events() == []


def test_a_completed_spill_is_held_and_announced(env: TierEnv) -> None:
    tier = env.index
    spill(tier, [K(1), K(2)])
    assert run(tier, [K(1), K(2), K(3)]) == 2
    assert tier.holds(K(1)) and tier.holds(K(2)) and not tier.holds(K(3))
    assert tier.held_count() == 2
    assert tier.metrics.value("transferred_chunks_total", direction="spill") == 2
    stored = [e for e in tier.take_events() if e.kind is EventKind.STORED]
    assert [k for e in stored for k in e.keys] == [K(1), K(2)]
    assert all(e.tier == env.name for e in stored)
    assert tier.take_events() == []  # drained


def test_lookups_change_nothing(env: TierEnv) -> None:
    tier = env.index
    spill(tier, [K(1)])
    tier.take_events()
    for _ in range(3):
        assert run(tier, [K(1), K(2)]) == 1
    assert tier.held_count() == 1 and tier.take_events() == []


def test_a_run_stops_at_the_first_chunk_not_held(env: TierEnv) -> None:
    tier = env.index
    spill(tier, [K(1), K(3)])
    assert run(tier, [K(1), K(2), K(3)]) == 1
    assert run(tier, [K(2), K(3)]) == 0


def test_a_failed_spill_is_not_held_and_is_counted(env: TierEnv) -> None:
    tier = env.index
    booking = tier.book_spill([K(1), K(2)])
    assert booking is not None
    tier.complete_spill([K(1)], [K(2)])
    assert tier.holds(K(1)) and not tier.holds(K(2))
    assert run(tier, [K(2)]) == 0
    assert tier.metrics.value("failed_chunks_total", direction="spill") == 1


def test_a_held_chunk_is_not_booked_again(env: TierEnv) -> None:
    tier = env.index
    spill(tier, [K(1)])
    booking = tier.book_spill([K(1), K(2)])
    assert booking is not None and booking.keys == (K(2),)


def test_a_promotion_keeps_what_it_found_and_forgets_what_was_bad(env: TierEnv) -> None:
    tier = env.index
    slots = spill(tier, [K(1), K(2), K(3)])
    tier.take_events()
    booked = tier.book_promotion([K(1), K(2), K(3)])
    assert booked == slots  # a slotted tier names where each chunk is; else ()
    tier.release_promotion([K(1), K(2), K(3)], bad=[K(2)])
    assert tier.holds(K(1)) and tier.holds(K(3)) and not tier.holds(K(2))
    assert run(tier, [K(1), K(2)]) == 1
    removed = [k for e in tier.take_events() if e.kind is EventKind.REMOVED for k in e.keys]
    assert removed == [K(2)]


def test_a_reset_forgets_every_chunk(env: TierEnv) -> None:
    tier = env.index
    spill(tier, [K(1), K(2)])
    tier.reset()
    assert tier.held_count() == 0 and not tier.holds(K(1))
    fresh = tier.book_spill([K(1)])
    assert fresh is not None and fresh.keys == (K(1),)  # offered again after the reset


# ---------------------------------------------------------------- TierStore


def write(env: TierEnv, keys: Sequence[ChunkKey], groups: Sequence[int] = ()) -> tuple[int, ...]:
    """Book ``keys`` in the index and write them through rank 0's store."""
    slots = spill(env.index, keys)
    store = env.stores[0] if env.stores else env.store()
    items = [(k, memoryview(data(i))) for i, k in enumerate(keys)]
    assert store.write_many(items, slots, groups) == [None] * len(keys)
    return slots


def read(
    env: TierEnv, keys: Sequence[ChunkKey], slots: Sequence[int], groups: Sequence[int] = ()
) -> tuple[list[ChunkFailure | None], list[bytes]]:
    outs = [bytearray(PAYLOAD) for _ in keys]
    failures = env.stores[0].read_many(keys, slots, [memoryview(o) for o in outs], groups)
    return failures, [bytes(o) for o in outs]


def test_what_is_written_reads_back_verified(env: TierEnv) -> None:
    keys = [K(1), K(2), K(3)]
    slots = write(env, keys)
    failures, got = read(env, keys, slots)
    assert failures == [None] * 3
    assert got == [data(i) for i in range(3)]


def test_each_rank_keeps_its_own_share(env: TierEnv) -> None:
    slots = write(env, [K(1)])
    other = env.store(rank=1)
    out = bytearray(PAYLOAD)
    failures = other.read_many([K(1)], slots, [memoryview(out)])
    assert failures[0] is not None  # rank 1 wrote nothing: a failed chunk, not rank 0's


def test_a_chunk_never_written_is_a_failed_chunk(env: TierEnv) -> None:
    write(env, [K(1)])
    booking = env.index.book_spill([K(9)])  # a place for it, never written
    assert booking is not None
    failures, _ = read(env, [K(9)], booking.slots)
    assert failures[0] is not None
    assert failures[0].kind in (FailureKind.MISSING, FailureKind.INTEGRITY)


def test_a_damaged_chunk_is_a_failed_chunk_and_stays_one(env: TierEnv) -> None:
    slots = write(env, [K(1), K(2)])
    env.damage(env.stores[0], K(2), slots[1] if slots else -1)
    failures, got = read(env, [K(1), K(2)], slots)
    assert failures[0] is None and got[0] == data(0)
    assert failures[1] is not None and failures[1].kind is FailureKind.INTEGRITY
    again, _ = read(env, [K(2)], slots[1:])
    assert again[0] is not None  # dropped where it was found: never read as good later


def test_a_chunk_read_as_another_group_is_an_integrity_failure(env: TierEnv) -> None:
    slots = write(env, [K(1)], groups=[1])
    failures, _ = read(env, [K(1)], slots, groups=[0])
    assert failures[0] is not None and failures[0].kind is FailureKind.INTEGRITY
    assert failures[0].detail == "group"


def test_a_read_under_another_key_fails(env: TierEnv) -> None:
    slots = write(env, [K(1)])
    failures, _ = read(env, [K(2)], slots)  # where K(1) is, asked as K(2)
    assert failures[0] is not None
