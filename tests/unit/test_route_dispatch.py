"""The real worker's backend runs a job's legs on their routes' lanes and reports the
job once, its legs' results merged; a job with a leg this worker has no lane for
fails at once with none of its legs started. Fakes stand in for the lanes: results
come when the test queues them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

from kvoffload.core.failures import error_failure
from kvoffload.core.jobs import NO_SLOT, EngineJob, JobKind, JobResult, StepPlan
from kvoffload.core.keys import ChunkKey
from kvoffload.transfer.staged_loads import StagedLoadLane
from kvoffload.transfer.step_backend import TransferBackend
from kvoffload.transfer.worker import TransferWorker


class FakeLane:
    """A transfer worker's or staged loads' calls the backend makes: every job
    submitted is recorded, results are queued by the test."""

    rank = 0

    def __init__(self) -> None:
        self.submitted: list[EngineJob] = []
        self.results: list[JobResult] = []
        self.polls = 0

    def submit_load(self, job: EngineJob) -> None:
        self.submitted.append(job)

    submit = submit_load

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> bool:
        return True

    def poll(self) -> list[JobResult]:
        self.polls += 1
        taken, self.results = self.results, []
        return taken


def tier_load(job_id: int = 5) -> EngineJob:
    """Chunks 0 and 2 from the disk tier, chunk 1 from host slot 7; two blocks each."""
    keys = tuple(ChunkKey(i.to_bytes(16, "big")) for i in range(1, 4))
    return EngineJob(
        job_id, JobKind.LOAD, "r", keys, (NO_SLOT, 7, NO_SLOT), tuple(range(20, 26)), 2,
        tier="disk", tier_slots=(3, 4),
    )  # fmt: skip


def backend(staged: FakeLane | None) -> tuple[TransferBackend, FakeLane]:
    copies = FakeLane()
    lanes = TransferBackend(
        cast(TransferWorker, copies),
        None,
        wait_for_loads=False,
        staged=cast(StagedLoadLane, staged),
    )
    return lanes, copies


def test_a_tier_load_runs_its_host_leg_as_a_part_and_is_reported_once_both_legs_came() -> None:
    staged = FakeLane()
    lanes, copies = backend(staged)
    job = tier_load()
    lanes.begin(StepPlan(1, loads=(job,)))
    lanes.submit(job)
    (part,) = copies.submitted
    assert (part.job_id, part.keys, part.slots, part.block_ids) == (
        5,
        job.keys[1:2],
        (7,),
        (22, 23),
    )
    assert staged.submitted == [job]
    copies.results = [JobResult(5, True, 100, 0.1)]
    (report,) = lanes.poll()
    assert report.results == () and lanes.take_loaded() == set()  # the tier leg is out
    staged.results = [JobResult(5, True, 200, 0.4)]
    (report,) = lanes.poll()
    assert report.results == (JobResult(5, True, 300, 0.4),)
    assert lanes.take_loaded() == {"r"} and lanes.take_invalid_blocks() == set()
    polls = staged.polls
    lanes.poll()
    assert staged.polls == polls  # no leg waits on the staged loads: not polled


def test_a_failed_tier_leg_fails_the_load_and_its_blocks_are_recomputed() -> None:
    staged = FakeLane()
    lanes, copies = backend(staged)
    job = tier_load()
    lanes.begin(StepPlan(1, loads=(job,)))
    lanes.submit(job)
    failure = error_failure("ConnectionError")
    staged.results = [JobResult(5, False, 0, 0.2, "ConnectionError", ((0, failure), (2, failure)))]
    copies.results = [JobResult(5, True, 100, 0.1)]
    (report,) = lanes.poll()
    (result,) = report.results
    assert not result.success and result.error == "ConnectionError"
    assert result.failed_chunks == ((0, failure), (2, failure)) and result.nbytes == 100
    assert lanes.take_invalid_blocks() == set(range(20, 26))


def test_a_tier_load_on_a_worker_without_staged_loads_fails_with_no_leg_started() -> None:
    lanes, copies = backend(None)
    job = tier_load()
    lanes.begin(StepPlan(1, loads=(job,)))
    lanes.submit(job)
    assert copies.submitted == []  # not even its host leg
    (report,) = lanes.poll()
    error = "no tier 'disk' on this worker"
    failed = ((0, error_failure(error)), (2, error_failure(error)))
    assert report.results == (JobResult(5, False, error=error, failed_chunks=failed),)
    assert lanes.take_invalid_blocks() == set(range(20, 26)) and lanes.take_loaded() == {"r"}


def test_a_repeated_result_passes_as_it_is_for_the_scheduler_half_to_count() -> None:
    lanes, copies = backend(None)
    keys = (ChunkKey(b"\x01" * 16),)
    job = EngineJob(6, JobKind.LOAD, "r", keys, (2,), (30, 31), 2)
    lanes.begin(StepPlan(1, loads=(job,)))
    lanes.submit(job)
    assert copies.submitted == [job]  # a leg of every chunk: the job itself
    copies.results = [JobResult(6, True, 10), JobResult(6, False, error="again")]
    (report,) = lanes.poll()
    assert report.results == (JobResult(6, True, 10), JobResult(6, False, error="again"))
    assert lanes.take_loaded() == {"r"} and lanes.take_invalid_blocks() == set()
