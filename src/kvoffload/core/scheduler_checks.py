"""Invariant checks of the scheduler half (tests, debug runs, the explorer)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvoffload.core.errors import ContractViolation
from kvoffload.core.jobs import JobKind
from kvoffload.core.request_state import Phase

if TYPE_CHECKING:
    from kvoffload.core.directory import Directory
    from kvoffload.core.job_tracker import JobTracker
    from kvoffload.core.request_state import RequestState


def _fail(what: str) -> None:
    raise ContractViolation(f"scheduler integrity: {what}")


def verify_scheduler(
    states: dict[str, RequestState], tracker: JobTracker, directory: Directory
) -> None:
    """Raise ContractViolation naming the first broken invariant."""
    directory.check_integrity()
    owned: set[int] = set()
    for request_id, state in states.items():
        if state.request_id != request_id:
            _fail(f"state of {request_id!r} names {state.request_id!r}")
        kinds = {job.kind for job in state.jobs.values()}
        loads = sum(job.kind is JobKind.LOAD for job in state.jobs.values())
        if loads > 1 or (loads and JobKind.STORE in kinds):
            _fail(f"{request_id!r} has {loads} loads and stores {state.store_ids()} in flight")
        phase = state.phase
        if phase is Phase.DONE:
            _fail(f"{request_id!r} is DONE but still tracked")
        if phase is Phase.LOADING and loads != 1:
            _fail(f"{request_id!r} is LOADING without a load")
        if phase is not Phase.LOADING and phase is not Phase.FINISHED_DRAINING and loads:
            _fail(f"{request_id!r} is {phase.name} with a load in flight")
        if phase in (Phase.WAITING,) and state.jobs:
            _fail(f"{request_id!r} is WAITING with jobs in flight")
        if phase is Phase.PREEMPTED_DRAINING and not state.jobs:
            _fail(f"{request_id!r} is draining with nothing in flight")
        if phase is Phase.FINISHED_DRAINING and not (state.jobs or state.final_store_pending):
            _fail(f"{request_id!r} finished, drained, still tracked")
        for job_id, job in state.jobs.items():
            if tracker.get(job_id) is not job:
                _fail(f"job {job_id} of {request_id!r} is not tracked")
            owned.add(job_id)
    orphans = [job.job_id for job in tracker.jobs() if job.job_id not in owned]
    if orphans:
        _fail(f"jobs {orphans} belong to no request")
    pins = sum(len(job.keys) for job in tracker.jobs() if job.kind is JobKind.LOAD)
    if directory.pinned_count != pins:
        _fail(f"{directory.pinned_count} pins held, in-flight loads account for {pins}")
    storing = sum(len(job.keys) for job in tracker.jobs() if job.kind is JobKind.STORE)
    if directory.storing_count != storing:
        _fail(f"{directory.storing_count} slots storing, in-flight stores account for {storing}")
    fences = sum(len(job.block_ids) for job in tracker.jobs() if job.kind is JobKind.STORE)
    if tracker.fence_count() != fences:
        _fail(f"{tracker.fence_count()} fences, in-flight stores read {fences} blocks")
