"""The real worker's :class:`~kvoffload.core.step_runner.StepBackend`.

Each job runs as its legs (:func:`kvoffload.core.tiering.routes.legs`), each on the lane of
its route (one table, ``_WAYS``): host -> engine and engine -> host on a
:class:`~kvoffload.transfer.worker.TransferWorker` (a leg of only some of a load's
chunks as a :meth:`~kvoffload.core.jobs.EngineJob.part` of the same job id), spills
and promotions on a :class:`~kvoffload.transfer.tier_worker.TierLane`, tier ->
engine on a :class:`~kvoffload.transfer.staged_loads.StagedLoadLane`. A job with a
leg whose lane this worker lacks fails at once, none of its legs started: a tier job
without a tier lane (``"no such tier"``), a tier load without staged loads (every
chunk of that leg with ``error_failure``); a load with no leg (it only names invalid
blocks) succeeds at once; while :attr:`TransferBackend.refusal` is set, every engine
load and store fails at once with it (the worker's weights fence, decision 0019); while
:attr:`TransferBackend.host_refusal` is set (a shared host tier whose slab is not the
plan's, decision 0018), a job with a leg that touches host slots fails at once with that
error; an engine load or store of a request named in
:attr:`TransferBackend.refused_requests` fails at once with the error it names (the
worker's LoRA fence, decision 0025). Nothing here raises for a failed job. Besides the results,
:meth:`TransferBackend.poll` notes which requests' loads finished and which engine
blocks are invalid (a failed load's blocks and the invalid blocks a load names), for
the engine to recompute.

A job of several legs (a tier load with host chunks) is reported once, when every
leg finished, its legs' results merged by :class:`~kvoffload.core.tiering.routes.LegResults`:
successful only when every leg was, ``nbytes`` summed, ``seconds`` the longest leg
(they run at once), ``error`` the first leg's that has one (the host leg's before
the tier's), ``failed_chunks`` every leg's (the transfer worker lists none).

A report's ``released`` are the tier lane's jobs whose I/O returned after their
deadline (:meth:`~kvoffload.transfer.tier_worker.TierWorker.take_returned`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
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
from kvoffload.core.tiering.routes import (
    FROM_HOST,
    FROM_TIER,
    PROMOTE,
    SPILL,
    TO_HOST,
    Leg,
    LegResults,
    Route,
    legs,
)
from kvoffload.transfer.staged_loads import StagedLoadLane
from kvoffload.transfer.tier_worker import TierLane
from kvoffload.transfer.worker import TransferWorker

_COPIES: frozenset[Route] = frozenset({FROM_HOST, TO_HOST})  # the transfer worker's routes
_TIER_LANE: frozenset[Route] = frozenset({SPILL, PROMOTE})
_STAGED: frozenset[Route] = frozenset({FROM_TIER})
_HOST_SLOTS: frozenset[Route] = _COPIES | _TIER_LANE  # the routes that touch host slots


@dataclass(frozen=True)
class _Open:
    """A job submitted and not polled yet, with its legs' results so far."""

    job: TransferJob
    legs: LegResults


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
        self.wait_for_loads = wait_for_loads
        self._step_loads: tuple[int, ...] = ()
        self._open: dict[int, _Open] = {}  # every job submitted, until polled
        self._staged_open: set[int] = set()  # jobs whose leg on the staged loads runs
        self._early: list[JobResult] = []  # tier jobs refused (no lane here): failed at once
        self._instant: list[JobResult] = []  # engine jobs refused or with no leg: done at once
        self._loaded: set[str] = set()
        self._invalid_blocks: set[int] = set()
        self._failed: set[str] = set()
        self.fail_by_request = fail_by_request
        # Set by the worker half per plan: engine loads and stores fail at once with
        # this error, none of their legs started (the weights fence, decision 0019).
        self.refusal: str | None = None
        # Likewise, per request (request id -> error): set by the worker half per
        # call of a plan (the LoRA fence, decision 0025).
        self.refused_requests: Mapping[str, str] = {}
        # Why jobs touching host slots fail at once now (None: they run); set by the
        # worker before each call of a plan (a shared host tier's slab that is not
        # the plan's, decision 0018).
        self.host_refusal: str | None = None

    def begin(self, plan: StepPlan) -> None:
        self._step_loads = tuple(job.job_id for job in plan.loads)

    def submit(self, job: TransferJob) -> None:
        """Run each leg of ``job`` on its route's lane, or fail the job at once (see
        the module docstring)."""
        job_legs = legs(job)
        self._open[job.job_id] = _Open(job, LegResults(job.job_id, job_legs))
        done = self._instant if isinstance(job, EngineJob) else self._early
        if not job_legs:  # a load of invalid blocks only: nothing to copy
            done.append(JobResult(job.job_id, True))
            return
        if isinstance(job, EngineJob):
            refusal = self.refusal or self.refused_requests.get(job.request_id)
            if refusal is not None:
                done.append(JobResult(job.job_id, False, error=refusal))
                return
        if self.host_refusal is not None and any(leg.route in _HOST_SLOTS for leg in job_legs):
            done.append(JobResult(job.job_id, False, error=self.host_refusal))
            return
        for leg in job_legs:
            way = _WAYS[leg.route]
            if way.lane(self) is None:
                done.append(way.refuse(job, leg))
                return
        for leg in job_legs:
            _WAYS[leg.route].run(self, job, leg)
            if leg.route in _STAGED:
                self._staged_open.add(job.job_id)

    def host_busy(self) -> bool:
        """Whether a job of this worker may still touch host slots: a copy running,
        or a spill or promotion running or quarantined (timed out, its I/O not back)."""
        if self.worker.running():
            return True
        tiers = self.tiers
        return tiers is not None and bool(tiers.running() or tiers.quarantined())

    def wait(self, job_ids: frozenset[int]) -> None:
        self.worker.wait(job_ids)
        if self.staged is not None and not self._staged_open.isdisjoint(job_ids):
            self.staged.wait(job_ids)

    def end_forward(self) -> None:
        """Nothing to do: the stores submitted next read what the pass computed."""

    def poll(self) -> list[WorkerReport]:
        """Refused jobs first, then the tier lane's results, then the copies' (in
        finishing order), jobs done at once, and the staged loads', each job once all
        its legs came, as one report of this worker's rank; finished loads are noted
        for :meth:`take_loaded`."""
        if self._step_loads and self.wait_for_loads:
            self.worker.wait(self._step_loads)
        early, self._early = self._early, []
        tier = self._arrived(self.tiers.poll(), _TIER_LANE) if self.tiers is not None else []
        copies = self._arrived(self.worker.poll(), _COPIES)
        instant, self._instant = self._instant, []
        staged = self.staged
        polled: list[JobResult] = []
        if staged is not None and self._staged_open:
            came = staged.poll()
            self._staged_open.difference_update(r.job_id for r in came)
            polled = self._arrived(came, _STAGED)
        results: list[JobResult] = []
        for result in (*early, *tier, *copies, *instant, *polled):
            results.append(result)
            opened = self._open.pop(result.job_id, None)
            job = opened.job if opened is not None else None
            if isinstance(job, EngineJob) and job.kind is JobKind.LOAD:
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

    def _arrived(self, results: Iterable[JobResult], lane: Collection[Route]) -> list[JobResult]:
        """The jobs ``results`` (of a lane serving ``lane``'s routes) end: each result
        recorded as its job's leg there, a job's merged result once its last leg's
        came; a result for no leg open here (an unknown job, a repeated result)
        passes as it is (the scheduler half counts it stale)."""
        ended = []
        for result in results:
            opened = self._open.get(result.job_id)
            if opened is None or not opened.legs.waiting(lane):
                ended.append(result)
                continue
            merged = opened.legs.add(result, lane)
            if merged is not None:
                ended.append(merged)
        return ended

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


# ---------------------------------------------------------------- the route table


def _from_host(backend: TransferBackend, job: TransferJob, leg: Leg) -> None:
    """A load's chunks from host slots: the whole job, or the part of the leg's."""
    assert isinstance(job, EngineJob)
    whole = len(leg.chunks) == len(job.keys)
    backend.worker.submit_load(
        job if whole else job.part(leg.chunks, [job.slots[c] for c in leg.chunks])
    )


def _to_host(backend: TransferBackend, job: TransferJob, leg: Leg) -> None:
    assert isinstance(job, EngineJob)
    backend.worker.submit_store(job)


def _tier_lane(backend: TransferBackend, job: TransferJob, leg: Leg) -> None:
    assert isinstance(job, TierJob) and backend.tiers is not None
    backend.tiers.submit(job)


def _from_tier(backend: TransferBackend, job: TransferJob, leg: Leg) -> None:
    """A load's chunks straight from a tier: the staged loads read the job's leg."""
    assert isinstance(job, EngineJob) and backend.staged is not None
    backend.staged.submit(job)


@dataclass(frozen=True)
class _Way:
    """How the backend runs a leg of one route: ``lane`` (None: not on this worker),
    ``run`` submits the leg there. A leg with no lane fails its job with ``absent``
    (``{tier}``: the leg's tier), listing the leg's chunks when ``lists_chunks`` (a
    load names the chunks it could not fill; a tier job that failed moved none)."""

    lane: Callable[[TransferBackend], object | None]
    run: Callable[[TransferBackend, TransferJob, Leg], None]
    absent: str = ""
    lists_chunks: bool = False

    def refuse(self, job: TransferJob, leg: Leg) -> JobResult:
        error = self.absent.format(tier=leg.tier)
        failed = tuple((c, error_failure(error)) for c in leg.chunks) if self.lists_chunks else ()
        return JobResult(job.job_id, False, error=error, failed_chunks=failed)


_WAYS: dict[Route, _Way] = {
    FROM_HOST: _Way(lambda b: b.worker, _from_host),
    TO_HOST: _Way(lambda b: b.worker, _to_host),
    SPILL: _Way(lambda b: b.tiers, _tier_lane, "no such tier"),
    PROMOTE: _Way(lambda b: b.tiers, _tier_lane, "no such tier"),
    FROM_TIER: _Way(lambda b: b.staged, _from_tier, "no tier {tier!r} on this worker", True),
}
