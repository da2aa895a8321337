"""A job's legs between media (core/tiering/routes.py): every job shape the scheduler half
builds, the contract over every tier-load slot pattern, and the merge of legs'
results."""

from __future__ import annotations

import itertools

import pytest

from kvoffload.core.errors import ContractViolation
from kvoffload.core.failures import MISSING, error_failure, integrity_failure
from kvoffload.core.jobs import NO_BLOCK, NO_SLOT, EngineJob, JobKind, JobResult, TierJob
from kvoffload.core.keys import ChunkKey
from kvoffload.core.tiering.routes import (
    ENGINE,
    FROM_HOST,
    FROM_TIER,
    HOST,
    PROMOTE,
    ROUTES,
    SPILL,
    TO_HOST,
    Endpoint,
    Leg,
    LegResults,
    Medium,
    leg_on,
    legs,
    lower,
    merge,
    tier_label,
)


def keys(n: int) -> tuple[ChunkKey, ...]:
    return tuple(ChunkKey(i.to_bytes(16, "big")) for i in range(1, n + 1))


def load(slots: tuple[int, ...], tier: str | None = None, k: int = 2) -> EngineJob:
    """A load of ``len(slots)`` chunks of ``k`` blocks (from ``tier`` where NO_SLOT)."""
    from_tier = slots.count(NO_SLOT)
    return EngineJob(
        7,
        JobKind.LOAD,
        "r",
        keys(len(slots)),
        slots,
        tuple(range(100, 100 + k * len(slots))),
        k,
        tier=tier,
        tier_slots=tuple(range(from_tier)) if tier else (),
    )


def test_a_load_reads_every_chunk_from_host_slots() -> None:
    job = load((4, 5, 6))
    assert legs(job) == (Leg(HOST, ENGINE, (0, 1, 2)),)
    assert tier_label(job) == "host"


def test_a_store_writes_every_chunk_into_host_slots() -> None:
    job = EngineJob(8, JobKind.STORE, "r", keys(2), (3, 1), (10, 11, 12, 13), 2)
    assert legs(job) == (Leg(ENGINE, HOST, (0, 1)),)
    assert tier_label(job) == "host"


def test_a_spill_goes_from_host_slots_to_its_tier() -> None:
    job = TierJob(9, JobKind.SPILL, keys(3), (0, 1, 2), "disk", (5, 6, 7))
    (leg,) = legs(job)
    assert leg == Leg(HOST, lower("disk"), (0, 1, 2))
    assert leg.route == SPILL and leg.tier == "disk" and tier_label(job) == "disk"


def test_a_promotion_goes_from_its_tier_to_host_slots() -> None:
    job = TierJob(10, JobKind.PROMOTE, keys(2), (4, 5), "redis", request_id="r")
    (leg,) = legs(job)
    assert leg == Leg(lower("redis"), HOST, (0, 1))
    assert leg.route == PROMOTE and leg.tier == "redis" and tier_label(job) == "redis"


def test_a_tier_load_reads_its_host_chunks_first_then_its_tier_chunks() -> None:
    job = load((NO_SLOT, 3, NO_SLOT, 4), tier="disk")
    assert legs(job) == (
        Leg(HOST, ENGINE, (1, 3)),
        Leg(lower("disk"), ENGINE, (0, 2)),
    )
    assert tier_label(job) == "disk"  # its host chunks count under its tier too
    assert leg_on(job, FROM_TIER) == Leg(lower("disk"), ENGINE, (0, 2))
    assert leg_on(job, TO_HOST) is None


def test_a_tier_load_of_tier_chunks_only_has_one_leg() -> None:
    job = load((NO_SLOT, NO_SLOT), tier="redis")
    assert legs(job) == (Leg(lower("redis"), ENGINE, (0, 1)),)
    assert leg_on(job, FROM_HOST) is None


def test_a_load_of_invalid_blocks_only_has_no_leg() -> None:
    job = EngineJob(11, JobKind.LOAD, "r", (), (), (), 2, invalid_blocks=(3, 4))
    assert legs(job) == ()
    assert tier_label(job) == "host"


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_slot_pattern_of_a_load_keeps_the_contract(n: int) -> None:
    """Every chunk on exactly one leg, no leg empty, distinct known routes, host leg
    first, each leg's chunks ascending and from the medium its slot says."""
    for from_tier in itertools.product((False, True), repeat=n):
        slots = tuple(NO_SLOT if t else 10 + i for i, t in enumerate(from_tier))
        for skip in (0, 1):
            job = load(slots, tier="disk" if any(from_tier) else None)
            if skip:
                job = EngineJob(
                    job.job_id, job.kind, job.request_id, job.keys, job.slots,
                    job.block_ids[1:], job.blocks_per_chunk, skip_blocks=1,
                    tier=job.tier, tier_slots=job.tier_slots,
                )  # fmt: skip
            found = legs(job)
            chunks = [c for leg in found for c in leg.chunks]
            assert sorted(chunks) == list(range(n)) and len(chunks) == n
            assert all(leg.chunks and list(leg.chunks) == sorted(leg.chunks) for leg in found)
            routes = [leg.route for leg in found]
            assert len(set(routes)) == len(routes) and set(routes) <= ROUTES
            assert routes == [r for r in (FROM_HOST, FROM_TIER) if r in routes]  # nearest first
            for leg in found:
                want = Medium.TIER if leg.route == FROM_TIER else Medium.HOST
                assert all((slots[c] == NO_SLOT) == (want is Medium.TIER) for c in leg.chunks)
                assert leg.destination == ENGINE


def test_a_hybrid_load_with_blocks_left_out_still_moves_every_chunk() -> None:
    job = EngineJob(12, JobKind.LOAD, "r", keys(2), (NO_SLOT, 3), (NO_BLOCK, 5, 6, 7), 2,
                    tier="disk", tier_slots=(9,))  # fmt: skip
    assert [leg.chunks for leg in legs(job)] == [(1,), (0,)]


def test_an_endpoint_names_its_medium_and_only_a_tier_has_a_tier_name() -> None:
    assert (ENGINE.name, HOST.name, lower("disk").name) == ("engine", "host", "disk")
    assert Leg(HOST, ENGINE, (0,)).tier is None
    with pytest.raises(ContractViolation):
        lower("")
    with pytest.raises(ContractViolation):
        Endpoint(Medium.HOST, "disk")


def test_one_legs_result_is_the_jobs_result() -> None:
    result = JobResult(3, False, 10, 0.5, "boom", ((0, MISSING),))
    assert merge(3, [result]) is result


def test_no_leg_merges_into_a_success_that_moved_nothing() -> None:
    assert merge(4, []) == JobResult(4, True)


def test_legs_merge_into_one_result() -> None:
    torn = integrity_failure("checksum")
    host = JobResult(5, True, 100, 0.25)
    tier = JobResult(5, False, 40, 0.75, torn, ((2, torn),))
    assert merge(5, [host, tier]) == JobResult(5, False, 140, 0.75, torn, ((2, torn),))
    failed_host = JobResult(5, False, 0, 0.5, "copy failed")
    both = merge(5, [failed_host, tier])
    assert both.error == "copy failed" and both.failed_chunks == ((2, torn),)  # leg order
    assert merge(5, [host, JobResult(5, True, 1, 0.1)]) == JobResult(5, True, 101, 0.25)


def test_leg_results_wait_for_every_leg_and_match_lanes_by_route() -> None:
    job = load((NO_SLOT, 3), tier="disk")
    pending = LegResults(job.job_id, legs(job))
    assert pending.waiting({FROM_TIER}) and pending.waiting({FROM_HOST, TO_HOST})
    failure = error_failure("gone")
    tier = JobResult(job.job_id, False, 0, 2.0, "gone", ((0, failure),))
    assert pending.add(tier, {FROM_TIER}) is None
    assert not pending.waiting({FROM_TIER}) and pending.waiting({FROM_HOST})
    merged = pending.add(JobResult(job.job_id, True, 64, 0.5), {FROM_HOST, TO_HOST})
    assert merged == JobResult(job.job_id, False, 64, 2.0, "gone", ((0, failure),))


def test_leg_results_refuse_a_result_for_no_open_leg() -> None:
    job = load((3,))
    pending = LegResults(job.job_id, legs(job))
    with pytest.raises(ContractViolation):
        pending.add(JobResult(job.job_id, True), {FROM_TIER})  # no such leg
    with pytest.raises(ContractViolation):
        pending.add(JobResult(99, True), {FROM_HOST})  # another job's
    assert pending.add(JobResult(job.job_id, True), {FROM_HOST}) == JobResult(job.job_id, True)
    with pytest.raises(ContractViolation):
        pending.add(JobResult(job.job_id, True), {FROM_HOST})  # came already
