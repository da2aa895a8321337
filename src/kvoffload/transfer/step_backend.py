"""The real worker's :class:`~kvoffload.core.step_runner.StepBackend`.

Loads and stores run on a :class:`~kvoffload.transfer.worker.TransferWorker`, spills
and promotions on a :class:`~kvoffload.transfer.tier_worker.TierLane`, the tier
chunks of tier loads on a :class:`~kvoffload.transfer.staged_loads.StagedLoadLane`
(their host chunks, as a part of the same job id, on the transfer worker). A tier
job on a worker without a tier lane fails at once (``"no such tier"``), as does a
tier load on a worker without staged loads (every tier chunk with
``error_failure``); a load with no chunk (it only names invalid blocks) succeeds at
once. Nothing here raises for a failed job. Besides the results,
:meth:`TransferBackend.poll` notes which requests' loads finished and which engine
blocks are invalid (a failed load's blocks and the invalid blocks a load names), for
the engine to recompute.

A tier load is reported once, when both halves finished: successful only when both
were, ``nbytes`` summed, ``seconds`` the longer half (they run at once), ``error``
the host half's else the tier half's, ``failed_chunks`` the tier half's.

A report's ``released`` are the tier lane's jobs whose I/O returned after their
deadline (:meth:`~kvoffload.transfer.tier_worker.TierWorker.take_returned`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvoffload.core.failures import error_failure
from kvoffload.core.jobs import (
    EngineJob,
    JobKind,
    JobResult,
    StepPlan,
    TierJob,
    TransferJob,
    WorkerReport,
)
from kvoffload.transfer.staged_loads import StagedLoadLane
from kvoffload.transfer.tier_worker import TierLane
from kvoffload.transfer.worker import TransferWorker


@dataclass
class _Halves:
    """A tier load's two results until both came (None: not yet)."""

    host: JobResult | None
    tier: JobResult | None = None


class TransferBackend:
    """Borrows ``worker``, ``tiers`` and ``staged`` (their owner shuts them down) and
    owns the jobs it submitted until their results were polled.

    ``tiers`` and ``staged`` may be replaced between steps (a harness wraps them).
    With ``wait_for_loads``, :meth:`poll` first waits for the current step's loads:
    they take a millisecond or so, and reporting them at once saves the waiting
    request a whole step (a copy hook that holds copies, in tests, needs it off). Of
    a tier load it waits for the host chunks only: the tier chunks are read from a
    disk or over the network (a Redis read may take up to its timeout), which must
    not stall the engine step; they are reported by the first poll after they landed.

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
        staged: StagedLoadLane | None = None,
    ) -> None:
        self.worker = worker
        self.tiers = tiers
        self.staged = staged
        self._halves: dict[int, _Halves] = {}  # tier loads with a half still running
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
        elif job.tier is not None:
            self._submit_tier_load(job)
        elif job.kind is JobKind.STORE:
            self.worker.submit_store(job)
        else:
            self.worker.submit_load(job)

    def _submit_tier_load(self, job: EngineJob) -> None:
        """The host chunks on the transfer worker, the tier chunks on the staged
        loads, both under the job's id (merged in :meth:`poll`)."""
        if self.staged is None:  # no lower tier on this worker
            error = f"no tier {job.tier!r} on this worker"
            failed = tuple((c, error_failure(error)) for c in job.tier_chunks())
            self._instant.append(JobResult(job.job_id, False, error=error, failed_chunks=failed))
            return
        host = job.host_chunks()
        self._halves[job.job_id] = _Halves(None if host else JobResult(job.job_id, True))
        if host:
            self.worker.submit_load(job.part(host, [job.slots[c] for c in host]))
        self.staged.submit(job)

    def wait(self, job_ids: frozenset[int]) -> None:
        self.worker.wait(job_ids)
        if self.staged is not None and self._halves.keys() & job_ids:
            self.staged.wait(job_ids)

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
        copies = [r for r in self.worker.poll() if self._complete(r, host=True)]
        staged = self.staged.poll() if self.staged is not None and self._halves else []
        merged = [r for r in staged if self._complete(r, host=False)]
        for done in (*copies, *instant, *merged):
            halves = self._halves.pop(done.job_id, None)
            result = done if halves is None else _merge(halves)
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
        released = tuple(self.tiers.take_returned()) if self.tiers is not None else ()
        return [WorkerReport(self.worker.rank, tuple(results), released)]

    def _complete(self, result: JobResult, *, host: bool) -> bool:
        """Whether ``result`` ends its job: any job's but a tier load's, whose other
        half must have come too (recorded here)."""
        halves = self._halves.get(result.job_id)
        if halves is None:
            return True
        if host:
            halves.host = result
        else:
            halves.tier = result
        return halves.host is not None and halves.tier is not None

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


def _merge(halves: _Halves) -> JobResult:
    """A tier load's result from its two halves' (see the module docstring)."""
    host, tier = halves.host, halves.tier
    assert host is not None and tier is not None
    return JobResult(
        host.job_id,
        success=host.success and tier.success,
        nbytes=host.nbytes + tier.nbytes,
        seconds=max(host.seconds, tier.seconds),
        error=host.error or tier.error,
        failed_chunks=tier.failed_chunks,
    )
