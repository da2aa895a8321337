"""Invariant checks of the scheduler half (tests, debug runs, the explorer).

Read-only. A request's jobs are the job tracker's (the one owner): the checks
compare each request's phase with the jobs the tracker holds for it, and the jobs in
flight with the directories' pins and storing slots and the tracker's fences."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvoffload.core.errors import ContractViolation
from kvoffload.core.jobs import EngineJob, JobKind, TierJob, TransferJob
from kvoffload.core.scheduler.request_state import Phase

if TYPE_CHECKING:
    from kvoffload.core.directory import HostDirectory
    from kvoffload.core.scheduler.job_tracker import JobTracker
    from kvoffload.core.scheduler.request_state import RequestState
    from kvoffload.core.tiering.planning import TierPlanner


def _fail(what: str) -> None:
    raise ContractViolation(f"scheduler integrity: {what}")


def verify_scheduler(
    states: dict[str, RequestState],
    tracker: JobTracker,
    directory: HostDirectory,
    tiers: TierPlanner | None = None,
    quarantined: Sequence[TierJob] = (),
) -> None:
    """Raise ContractViolation naming the first broken invariant. ``quarantined``:
    timed-out spills and promotions whose completion waits for their I/O (they hold
    pins and slots as jobs in flight do; they belong to no request any more)."""
    directory.check_integrity()
    for request_id, state in states.items():
        if state.request_id != request_id:
            _fail(f"state of {request_id!r} names {state.request_id!r}")
        _check_request(state, tracker.jobs_of(request_id))
    in_flight = tracker.jobs()
    orphans = [
        j.job_id for j in in_flight if j.request_id is not None and j.request_id not in states
    ]
    if orphans:
        _fail(f"jobs {orphans} belong to no request")
    jobs = [*in_flight, *quarantined]
    queued = tiers.queued_pins() if tiers is not None else 0
    pins = _host_keys_of(jobs, JobKind.LOAD, JobKind.SPILL) + queued
    if directory.pinned_count != pins:
        _fail(
            f"{directory.pinned_count} pins held, in-flight loads and spills and queued "
            f"spills account for {pins}"
        )
    storing = _keys_of(jobs, JobKind.STORE, JobKind.PROMOTE)
    if directory.storing_count != storing:
        _fail(f"{directory.storing_count} slots storing, in-flight jobs account for {storing}")
    for tier in tiers.directory_tiers() if tiers is not None else ():
        tier.directory.check_integrity()
        mine = [j for j in jobs if isinstance(j, TierJob) and j.tier == tier.name]
        tier_loads = [j for j in jobs if isinstance(j, EngineJob) and j.tier == tier.name]
        reads = _keys_of(mine, JobKind.PROMOTE) + sum(len(j.tier_chunks()) for j in tier_loads)
        if tier.directory.pinned_count != reads:
            _fail(f"tier {tier.name}: pins do not match its in-flight promotions and tier loads")
        if tier.directory.storing_count != _keys_of(mine, JobKind.SPILL):
            _fail(f"tier {tier.name}: storing slots do not match its in-flight spills")
    fences = sum(
        len(set(job.block_ids))
        for job in jobs
        if isinstance(job, EngineJob) and job.kind is JobKind.STORE
    )
    if tracker.fence_count() != fences:
        _fail(f"{tracker.fence_count()} fences, in-flight stores read {fences} blocks")


def _check_request(state: RequestState, jobs: Sequence[TransferJob]) -> None:
    """The request's phase agrees with its jobs in flight (``jobs``, the tracker's)."""
    request_id, phase = state.request_id, state.phase
    loads = sum(job.kind is JobKind.LOAD for job in jobs)
    promotions = sum(job.kind is JobKind.PROMOTE for job in jobs)
    stores = [job.job_id for job in jobs if job.kind is JobKind.STORE]
    if phase is Phase.PROMOTING and promotions != 1:
        _fail(f"{request_id!r} is PROMOTING with {promotions} promotions")
    if promotions > 1:
        _fail(f"{request_id!r} has {promotions} promotions in flight")
    if loads > 1 or (loads and stores):
        _fail(f"{request_id!r} has {loads} loads and stores {stores} in flight")
    if phase is Phase.DONE:
        _fail(f"{request_id!r} is DONE but still tracked")
    if phase is Phase.LOADING and loads != 1:
        _fail(f"{request_id!r} is LOADING without a load")
    if phase not in (Phase.LOADING, Phase.FINISHED_DRAINING) and loads:
        _fail(f"{request_id!r} is {phase.name} with a load in flight")
    if phase is Phase.WAITING and jobs:
        _fail(f"{request_id!r} is WAITING with jobs in flight")
    if phase is Phase.PREEMPTED_DRAINING and not jobs:
        _fail(f"{request_id!r} is draining with nothing in flight")
    if phase is Phase.FINISHED_DRAINING and not jobs:
        _fail(f"{request_id!r} finished, drained, still tracked")


def _host_keys_of(jobs: Sequence[TransferJob], *kinds: JobKind) -> int:
    """Chunks the jobs of ``kinds`` read or write in host memory (a tier load's tier
    chunks are not there)."""
    return sum(
        len(job.host_chunks()) if isinstance(job, EngineJob) and job.tier else len(job.keys)
        for job in jobs
        if job.kind in kinds
    )


def _keys_of(jobs: Sequence[TransferJob], *kinds: JobKind) -> int:
    return sum(len(job.keys) for job in jobs if job.kind in kinds)
