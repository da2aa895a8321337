"""The real worker's :class:`~kvoffload.core.step_runner.StepBackend`.

Loads and stores run on a :class:`~kvoffload.transfer.worker.TransferWorker`, spills
and promotions on a :class:`~kvoffload.transfer.tier_worker.TierLane`. A tier job on
a worker without a tier lane fails at once (``"no such tier"``); a load with no chunk
(it only names invalid blocks) succeeds at once. Nothing here raises for a failed
job. Besides the results, :meth:`TransferBackend.poll` notes which requests' loads
finished and which engine blocks are invalid (a failed load's blocks and the invalid
blocks a load names), for the engine to recompute.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.core.jobs import (
    EngineJob,
    JobKind,
    JobResult,
    StepPlan,
    TierJob,
    TransferJob,
    WorkerReport,
)
from kvoffload.transfer.tier_worker import TierLane
from kvoffload.transfer.worker import TransferWorker


class TransferBackend:
    """Borrows ``worker`` and ``tiers`` (their owner shuts them down) and owns the
    jobs it submitted until their results were polled.

    ``tiers`` may be replaced between steps (a harness wraps it). With
    ``wait_for_loads``, :meth:`poll` first waits for the current step's loads: they
    take a millisecond or so, and reporting them at once saves the waiting request a
    whole step (a copy hook that holds copies, in tests, needs it off).

    A failed load's blocks are noted for vLLM to recompute (:meth:`take_invalid_blocks`);
    with ``fail_by_request`` (anything but one full-attention KV cache group) its
    request instead (:meth:`take_failed`): with several groups block ids name no group
    and vLLM refuses them, with a sliding window vLLM would recompute from the first
    invalid block with the window before it missing (its null blocks)."""

    def __init__(
        self,
        worker: TransferWorker,
        tiers: TierLane | None,
        *,
        wait_for_loads: bool,
        fail_by_request: bool = False,
    ) -> None:
        self.worker = worker
        self.tiers = tiers
        self.wait_for_loads = wait_for_loads
        self._step_loads: tuple[int, ...] = ()
        self._jobs: dict[int, EngineJob] = {}  # loads and stores until polled
        self._early: list[JobResult] = []  # tier jobs with no tier lane: failed at once
        self._instant: list[JobResult] = []  # loads of invalid blocks only: done at once
        self._loaded: set[str] = set()
        self._invalid_blocks: set[int] = set()
        self._failed: set[str] = set()
        self.fail_by_request = fail_by_request

    def begin(self, plan: StepPlan) -> None:
        self._step_loads = tuple(job.job_id for job in plan.loads)

    def submit(self, job: TransferJob) -> None:
        if isinstance(job, TierJob):
            if self.tiers is not None:
                self.tiers.submit(job)
            else:  # no tier configured on this worker: report the job failed
                self._early.append(JobResult(job.job_id, False, error="no such tier"))
            return
        self._jobs[job.job_id] = job
        if not job.slots:  # a load of invalid blocks only: nothing to copy
            self._instant.append(JobResult(job.job_id, True))
        elif job.kind is JobKind.STORE:
            self.worker.submit_store(job)
        else:
            self.worker.submit_load(job)

    def wait(self, job_ids: frozenset[int]) -> None:
        self.worker.wait(job_ids)

    def end_forward(self) -> None:
        """Nothing to do: the stores submitted next read what the pass computed."""

    def poll(self) -> list[WorkerReport]:
        """Tier results first, then the copies' (in finishing order), as one report
        of this worker's rank; finished loads are noted for :meth:`take_loaded`."""
        if self._step_loads and self.wait_for_loads:
            self.worker.wait(self._step_loads)
        results, self._early = self._early, []
        if self.tiers is not None:
            results.extend(self.tiers.poll())
        instant, self._instant = self._instant, []
        for result in (*self.worker.poll(), *instant):
            results.append(result)
            job = self._jobs.pop(result.job_id, None)
            if job is not None and job.kind is JobKind.LOAD:
                self._loaded.add(job.request_id)
                failed = set(job.invalid_blocks)
                if not result.success:
                    failed.update(job.moved_blocks())
                if failed and self.fail_by_request:
                    self._failed.add(job.request_id)
                else:
                    self._invalid_blocks.update(failed)
        return [WorkerReport(self.worker.rank, tuple(results))]

    def applied(self, reports: Sequence[WorkerReport]) -> None:
        """Nothing to do: a job is forgotten once its result was polled."""

    def take_loaded(self) -> set[str]:
        """Ids of the requests whose load finished (or failed) since the last call."""
        loaded, self._loaded = self._loaded, set()
        return loaded

    def take_failed(self) -> set[str]:
        """Requests whose load failed since the last call (``fail_by_request``)."""
        failed, self._failed = self._failed, set()
        return failed

    def take_invalid_blocks(self) -> set[int]:
        """Engine blocks to recompute, noted since the last call."""
        invalid, self._invalid_blocks = self._invalid_blocks, set()
        return invalid
