"""The reference engine: scheduling, the forward pass, and applying outputs.

Each engine step schedules a batch (running requests first, preempting the most
recent ones by recompute when blocks run out; then waiting requests, looked up in
kvoffload's scheduler half), builds kvoffload's plan, runs the worker's
pre-forward part of the plan (flushes, loads), the forward pass, and collects the
worker's reports. Applying a batch's output (sampled tokens, finished requests,
the reports) happens right after it in ``SYNC`` mode, and only after the *next*
batch was scheduled and run in ``BATCH_QUEUE`` mode: exactly the window in which a
preempted request can be re-admitted before its flushed stores are acknowledged.

It calls the scheduler half as the vLLM adapter does: ``lookup`` and
``on_allocated`` while scheduling, ``build_plan`` once per step, ``on_finished`` /
``on_aborted`` before freeing a request's blocks, ``on_report`` when applying.

The forward pass and the batch former are given to the constructor (a
:class:`~kvoffload.engine.strategies.Model`, a
:class:`~kvoffload.engine.batcher.Batcher` with its strategies); the defaults are the
deterministic model and the reference batcher (one KV cache group; a batcher with
other block tables needs another model). ``on_finished`` observes every
finished request; with ``keep_finished=False`` finished requests leave ``requests``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kvoffload.core.jobs import JobKind, StepPlan, WorkerReport
from kvoffload.core.scheduler import OffloadScheduler
from kvoffload.core.scheduler_types import StepInput
from kvoffload.engine.batcher import Batcher
from kvoffload.engine.block_pool import BlockPool
from kvoffload.engine.request import Request, Status
from kvoffload.engine.settings import EngineConfig, StepMode
from kvoffload.engine.strategies import DeterministicModel, Model, Sampled
from kvoffload.engine.tables import OneTable


class EngineWorker(Protocol):
    """The worker half as the engine drives it, once per step, in this order."""

    def begin_step(self, plan: StepPlan) -> None:
        """Before the forward pass: finish ``plan.flush``, take loads and stores."""

    def end_forward(self) -> None:
        """After the forward pass: this step's stores may run from now on."""

    def collect(self) -> list[WorkerReport]:
        """Results to send back with this step's output (one report per worker)."""

    def applied(self, reports: list[WorkerReport]) -> None:
        """The engine applied ``reports`` to the scheduler half."""


@dataclass
class StepBatch:
    """One step's results between its two phases: the tokens its forward sampled and
    the workers' reports collected after it, not yet applied (see
    :meth:`ReferenceEngine.run_step`)."""

    step: int
    sampled: list[Sampled] = field(default_factory=list)
    reports: list[WorkerReport] = field(default_factory=list)


class ReferenceEngine:
    """See the module docstring. Owns its requests, block pool, batcher (queues) and
    model; drives the scheduler half and the worker it is given. Raises ValueError
    for a scheduler half without a worker (or the reverse), or a batcher over
    another pool or scheduler half."""

    def __init__(
        self,
        config: EngineConfig,
        scheduler: OffloadScheduler | None = None,
        worker: EngineWorker | None = None,
        pool: BlockPool | None = None,
        *,
        model: Model | None = None,
        batcher: Batcher | None = None,
        on_finished: Callable[[Request], None] | None = None,
        keep_finished: bool = True,
    ) -> None:
        if (scheduler is None) != (worker is None):
            raise ValueError("give both a scheduler half and a worker, or neither")
        self.config = config
        self.scheduler = scheduler
        self.worker = worker
        self.pool = pool or BlockPool(config.num_blocks, config.block_size)
        self.pool.caching = config.enable_prefix_caching
        if batcher is not None and (
            batcher.pool is not self.pool or batcher.scheduler is not scheduler
        ):
            raise ValueError("the batcher must use the engine's block pool and scheduler half")
        self.batcher = batcher or Batcher(config, self.pool, scheduler)
        if model is None and not isinstance(self.batcher.tables, OneTable):
            raise ValueError("the deterministic model reads one block table: give a model")
        self.model: Model = model or DeterministicModel(self.pool, config.block_size, config.vocab)
        self.on_finished = on_finished  # called after a request finished, blocks freed
        self.keep_finished = keep_finished
        self.requests: dict[str, Request] = {}
        self.steps = 0
        self._in_flight: StepBatch | None = None
        self._load_jobs: dict[int, str] = {}

    # ------------------------------------------------------------------ requests

    @property
    def waiting(self) -> list[Request]:
        return self.batcher.waiting

    @property
    def running(self) -> list[Request]:
        return self.batcher.running

    @property
    def preemptions(self) -> int:
        return self.batcher.preemptions

    def add_request(
        self, request_id: str, prompt: list[int], max_tokens: int, salt: str | None = None
    ) -> Request:
        req = Request(request_id, prompt, max_tokens, self.config.block_size, salt)
        self.add(req)
        return req

    def add(self, req: Request) -> None:
        """Queue ``req``, built by the caller (of the engine's block size, with a new
        id); the engine owns it from now on."""
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> None:
        """Abort between steps. A request waiting for its load keeps its blocks until
        the load is reported."""
        req = self.requests.get(request_id)
        if req is None or req.done:
            return
        if req in self.waiting:
            self.waiting.remove(req)
        if req in self.running:
            self.running.remove(req)
        keep_blocks = req.status is Status.WAITING_FOR_LOAD and req.load_ok is None
        req.status = Status.ABORTED
        if self.scheduler is not None:
            self.scheduler.on_aborted(request_id)
        if not keep_blocks:
            self.batcher.free_blocks(req)

    @property
    def idle(self) -> bool:
        """Nothing left to do: no request, no job, no output still to apply."""
        queued = self._in_flight
        unapplied = queued is not None and (
            queued.sampled or any(report.results for report in queued.reports)
        )
        busy = self.waiting or self.running or unapplied
        jobs = self.scheduler is not None and (
            self.scheduler.has_pending_work() or self.scheduler.request_ids()
        )
        return not busy and not jobs

    # ------------------------------------------------------------------ stepping

    def step(self) -> None:
        batch = self.run_step()
        if self.config.mode is StepMode.SYNC:
            self.apply_step(batch)
            return
        previous, self._in_flight = self._in_flight, batch
        if previous is not None:
            self.apply_step(previous)

    def run_until_idle(self, max_steps: int) -> bool:
        """Step until the engine is idle (at most ``max_steps`` steps), then apply the
        batch still in the queue; whether it ended idle."""
        for _ in range(max_steps):
            if self.idle:
                break
            self.step()
        self.drain()
        return self.idle

    def drain(self) -> None:
        """Apply the batch still in the queue (batch-queue mode)."""
        if self._in_flight is not None:
            batch, self._in_flight = self._in_flight, None
            self.apply_step(batch)

    def run_step(self) -> StepBatch:
        """First phase of a step: schedule, plan and hand the plan to the worker, run
        the forward, collect the workers' reports and cache the computed blocks. The
        sampled tokens and the reports are returned unapplied; the caller applies each
        batch exactly once, in order, with :meth:`apply_step` (``step`` does both, a
        batch late in batch-queue mode; a driver of several engines interleaves the
        phases in its own time order)."""
        self.steps += 1
        scheduled, preempted = self.batcher.schedule()
        batch = StepBatch(self.steps)
        if self.scheduler is not None and self.worker is not None:
            plan = self.scheduler.build_plan(StepInput(tuple(s for s, _ in scheduled), preempted))
            for job in plan.loads:
                self._load_jobs[job.job_id] = job.request_id
            self.worker.begin_step(plan)
        for sched, req in scheduled:
            self.model.forward(req, sched, batch.sampled)
        if self.worker is not None:
            self.worker.end_forward()
            batch.reports = self.worker.collect()
        for _, req in scheduled:
            self.batcher.cache_computed(req)
        return batch

    # ---------------------------------------------------------------- outputs

    def apply_step(self, batch: StepBatch) -> None:
        """Second phase: the sampled tokens reach their requests (finishing some) and
        the reports reach the scheduler half (completions, load outcomes)."""
        self.model.apply(batch.sampled, self._finish)
        if self.scheduler is None:
            return
        for report in batch.reports:
            for completion in self.scheduler.on_report(report):
                if completion.job.kind is JobKind.LOAD:
                    self._load_reported(completion.job.job_id, completion.success)
        if self.worker is not None:
            self.worker.applied(batch.reports)

    def _load_reported(self, job_id: int, success: bool) -> None:
        req = self.requests[self._load_jobs.pop(job_id)]
        if req.status is Status.ABORTED:
            self.batcher.free_blocks(req)
        else:
            req.load_ok = success

    def _finish(self, req: Request) -> None:
        self.running.remove(req)
        req.status = Status.FINISHED
        req.pending.clear()
        if self.scheduler is not None:
            self.scheduler.on_finished(req.request_id)
        self.batcher.free_blocks(req)
        if not self.keep_finished:
            del self.requests[req.request_id]
        if self.on_finished is not None:
            self.on_finished(req)
