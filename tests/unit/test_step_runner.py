"""The step runner's order and bookkeeping, and the real worker's backend."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import cast

from kvoffload.core.jobs import (
    EngineJob,
    JobKind,
    JobResult,
    StepPlan,
    TierJob,
    TransferJob,
    WorkerReport,
)
from kvoffload.core.keys import ChunkKey
from kvoffload.core.step_runner import StepRunner
from kvoffload.transfer.step_backend import TransferBackend
from kvoffload.transfer.worker import TransferWorker


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "little"))


def copy(job_id: int, kind: JobKind, request: str = "r", slots: int = 1) -> EngineJob:
    return EngineJob(
        job_id,
        kind,
        request,
        tuple(key(job_id * 10 + i) for i in range(slots)),
        tuple(range(slots)),
        tuple(range(job_id * 10, job_id * 10 + slots)),
        1,
    )


def tier_job(job_id: int, kind: JobKind) -> TierJob:
    request = "r" if kind is JobKind.PROMOTE else None  # a spill serves no request
    return TierJob(job_id, kind, (key(job_id),), (0,), "disk", request_id=request)


class Recorder:
    """A backend that records every call."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def begin(self, plan: StepPlan) -> None:
        self.calls.append(f"begin {plan.step}")

    def submit(self, job: TransferJob) -> None:
        self.calls.append(f"submit {job.job_id}")

    def wait(self, job_ids: frozenset[int]) -> None:
        self.calls.append(f"wait {sorted(job_ids)}")

    def end_forward(self) -> None:
        self.calls.append("end_forward")

    def poll(self) -> list[WorkerReport]:
        self.calls.append("poll")
        return [WorkerReport(0, (JobResult(1, True),))]

    def applied(self, reports: Sequence[WorkerReport]) -> None:
        self.calls.append(f"applied {len(reports)}")


def plan(step: int) -> StepPlan:
    return StepPlan(
        step,
        loads=(copy(3, JobKind.LOAD),),
        stores=(copy(1, JobKind.STORE), copy(2, JobKind.STORE)),
        flush=frozenset({2, 7}),  # 7: a store of an earlier step
        spills=(tier_job(4, JobKind.SPILL),),
        promotions=(tier_job(5, JobKind.PROMOTE),),
    )


def test_a_step_runs_flush_loads_tier_jobs_forward_stores_in_that_order() -> None:
    runner = StepRunner(Recorder())
    runner.flush(plan(1))
    runner.begin_step(plan(1))
    runner.begin_step(plan(1))  # a step's calls are idempotent
    runner.end_forward()
    reports = runner.collect()
    runner.applied(reports)
    assert runner.backend.calls == [
        "begin 1",
        "submit 2",  # the flushed store, then the wait for every flushed job
        "wait [2, 7]",
        "submit 3",
        "submit 4",
        "submit 5",
        "end_forward",
        "submit 1",  # the other store: it captures what the forward pass computed
        "poll",
        "applied 1",
    ]
    assert runner.plan == plan(1)


def test_a_new_step_begins_again_and_a_plan_without_flush_waits_for_nothing() -> None:
    runner = StepRunner(Recorder())
    runner.begin_step(plan(1))
    runner.backend.calls.clear()
    runner.begin_step(StepPlan(2, loads=(copy(8, JobKind.LOAD),)))
    assert runner.backend.calls == ["begin 2", "submit 8"]


class FakeCopies:
    """What the backend uses of a transfer worker: results are queued by the test."""

    rank = 3

    def __init__(self) -> None:
        self.submitted: list[tuple[str, int]] = []
        self.results: list[JobResult] = []
        self.waited: list[set[int]] = []

    def submit_store(self, job: TransferJob) -> None:
        self.submitted.append(("store", job.job_id))

    def submit_load(self, job: TransferJob) -> None:
        self.submitted.append(("load", job.job_id))

    def wait(self, job_ids: Iterable[int]) -> None:
        self.waited.append(set(job_ids))

    def poll(self) -> list[JobResult]:
        taken, self.results = self.results, []
        return taken


def test_the_real_backend_fails_tier_jobs_without_a_tier_and_reports_loads() -> None:
    copies = FakeCopies()
    backend = TransferBackend(cast(TransferWorker, copies), None, wait_for_loads=True)
    nothing_to_copy = EngineJob(6, JobKind.LOAD, "b", (), (), (), 1, invalid_blocks=(40, 41))
    step = StepPlan(1, loads=(copy(3, JobKind.LOAD, "a"), nothing_to_copy))
    runner = StepRunner(backend)
    runner.begin_step(step)
    runner.backend.submit(tier_job(4, JobKind.SPILL))
    runner.backend.submit(copy(2, JobKind.STORE))
    assert copies.submitted == [("load", 3), ("store", 2)]
    copies.results = [JobResult(3, False, error="torn"), JobResult(2, True)]
    (report,) = runner.collect()
    assert copies.waited == [{3, 6}]  # this step's loads, before polling
    assert report.rank == 3
    assert [(r.job_id, r.success, r.error) for r in report.results] == [
        (4, False, "no such tier"),
        (3, False, "torn"),
        (2, True, ""),
        (6, True, ""),
    ]
    assert backend.take_loaded() == {"a", "b"} and backend.take_loaded() == set()
    assert backend.take_invalid_blocks() == {30, 40, 41}


def test_with_a_copy_hook_the_backend_does_not_wait_for_the_steps_loads() -> None:
    copies = FakeCopies()
    backend = TransferBackend(cast(TransferWorker, copies), None, wait_for_loads=False)
    runner = StepRunner(backend)
    runner.begin_step(StepPlan(1, loads=(copy(3, JobKind.LOAD),)))
    assert runner.collect() == [WorkerReport(3, ())]
    assert copies.waited == []
