"""Running one :class:`StepPlan` on a worker: the order every worker half keeps.

A :class:`StepRunner` is the engine's worker
(:class:`~kvoffload.engine.engine.EngineWorker`) over a :class:`StepBackend`, which
moves the bytes (real copies and tier lanes, the reference engine's in-memory
worker, the simulator's timed lanes). Per step, in this order:

1. **flush** (the step's first call): the backend learns the plan (``begin``), the
   plan's flushed stores are submitted, and the runner waits for every flushed job
   (``plan.flush``; also earlier steps' stores), since the forward pass overwrites
   the blocks they read;
2. **before the forward pass**: the loads, then the spills and promotions, are
   submitted (a load's blocks belong to requests that do not run this step);
3. **after the forward pass** (``end_forward``): the remaining stores are submitted,
   so they capture what this step computed;
4. **collect**: the backend's reports; **applied**: the engine acknowledged them.

The runner owns the per-step bookkeeping (the step's plan, the jobs of it already
submitted): every call of a step is idempotent, and each job of a plan is submitted
exactly once, from that plan only. It owns no job in flight and raises nothing of
its own; whatever the backend raises propagates. Torch-free, like the rest of core.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Generic, Protocol, TypeVar

from kvoffload.core.jobs import StepPlan, TransferJob, WorkerReport


class StepBackend(Protocol):
    """What moves a plan's jobs; called by one :class:`StepRunner`, in its order."""

    def begin(self, plan: StepPlan) -> None:
        """A new step: called once, before any job of ``plan`` is submitted."""

    def submit(self, job: TransferJob) -> None:
        """Start ``job`` (called once per job; see the module docstring for when).
        A job that cannot run becomes a failed result, it does not raise."""

    def wait(self, job_ids: frozenset[int]) -> None:
        """Return once the jobs named (submitted in this step or earlier) finished;
        their results stay for :meth:`poll`. Ids unknown or reported are fine."""

    def end_forward(self) -> None:
        """The forward pass ended; the step's remaining stores are submitted next."""

    def poll(self) -> list[WorkerReport]:
        """Results of the jobs finished since the previous poll, one report per rank."""

    def applied(self, reports: Sequence[WorkerReport]) -> None:
        """The engine applied ``reports`` (from :meth:`poll`) to the scheduler half."""


B = TypeVar("B", bound=StepBackend)


class StepRunner(Generic[B]):
    """Runs each step's plan on ``backend`` (see the module docstring); the backend
    is the caller's to configure, the runner only drives it."""

    def __init__(self, backend: B) -> None:
        self.backend = backend
        self._plan: StepPlan | None = None
        self._submitted: set[int] = set()

    @property
    def plan(self) -> StepPlan | None:
        """The plan of the step being run (None before the first step)."""
        return self._plan

    def flush(self, plan: StepPlan) -> None:
        """Start ``plan``'s step if it is a new one: ``begin``, submit its flushed
        stores, wait for every flushed job. A no-op for the step already started."""
        if self._plan is not None and plan.step == self._plan.step:
            return
        self._plan = plan
        self._submitted = set()  # jobs are only ever submitted from their own plan
        self.backend.begin(plan)
        for job in plan.stores:
            if job.job_id in plan.flush:
                self._submit(job)
        if plan.flush:
            self.backend.wait(plan.flush)

    def begin_step(self, plan: StepPlan) -> None:
        """Before the forward pass: :meth:`flush`, then submit the loads, spills and
        promotions not submitted yet."""
        self.flush(plan)
        for jobs in (plan.loads, plan.spills, plan.promotions):
            for job in jobs:
                self._submit(job)

    def end_forward(self) -> None:
        """After the forward pass: tell the backend, then submit the step's stores
        not submitted yet."""
        self.backend.end_forward()
        if self._plan is None:
            return
        for job in self._plan.stores:
            self._submit(job)

    def collect(self) -> list[WorkerReport]:
        """The backend's reports of the jobs finished since the previous collect."""
        return self.backend.poll()

    def applied(self, reports: Sequence[WorkerReport]) -> None:
        """The engine applied ``reports`` to the scheduler half."""
        self.backend.applied(reports)

    def _submit(self, job: TransferJob) -> None:
        if job.job_id in self._submitted:
            return
        self._submitted.add(job.job_id)
        self.backend.submit(job)
