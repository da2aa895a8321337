"""Run one schedule (a scenario plus completion decisions) and check everything.

After every engine step: the scheduler half's and the directory's integrity. During
the run, the manual worker's checks (loads vs unacknowledged stores, fences, bytes,
tenant isolation). At the end: quiescence (no pins, no STORING slots, no jobs),
termination within a step bound, and every finished request's tokens equal to the
reference model's (what an engine without offloading produces).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvoffload.core.directory import Directory, HostDirectory
from kvoffload.core.jobs import StepPlan, WorkerReport
from kvoffload.core.keys import Namespace
from kvoffload.core.scheduler import OffloadScheduler
from kvoffload.core.scheduler_types import EngineRequest, SchedulerConfig, StepInput
from kvoffload.core.step_runner import StepRunner
from kvoffload.engine.block_pool import BlockPool
from kvoffload.engine.engine import ReferenceEngine
from kvoffload.engine.manual_worker import InvariantViolation, ManualWorker
from kvoffload.engine.model import reference_outputs
from kvoffload.engine.request import Status
from kvoffload.engine.settings import EngineConfig
from kvoffload.testing.oracle import Oracle
from kvoffload.testing.policies import Chooser, Decision, DecisionPolicy
from kvoffload.testing.scenario import Scenario
from kvoffload.tiers.build import build_scheduler, directory_tiers

NAMESPACE = Namespace(model="reference", layout="kv8", dtype="bytes")
VOCAB = 1000

_CATEGORIES = (
    ("issued while its store jobs", "load while jobs in flight"),
    ("PREEMPTED_DRAINING -> LOADING", "load while jobs in flight"),
    ("PROMOTING -> LOADING", "load while jobs in flight"),
    ("written while store job", "block overwritten under a store"),
    ("outside its own key chain", "cross-tenant chunk"),
    ("wrong bytes", "wrong bytes"),
    ("which holds", "wrong bytes"),
)


@dataclass
class Outcome:
    violation: str | None = None
    category: str | None = None
    steps: int = 0
    decisions: list[str] = field(default_factory=list)
    branch_steps: list[int] = field(default_factory=list)
    trace: list[str] = field(default_factory=list)
    preemptions: int = 0
    loads: int = 0
    stores: int = 0
    deferrals: int = 0

    @property
    def branch_points(self) -> int:
        return len(self.decisions)


def _category(message: str) -> str:
    for needle, name in _CATEGORIES:
        if needle in message:
            return name
    return "invariant"


def run_schedule(
    scenario: Scenario,
    decisions: Sequence[Decision] = (),
    *,
    chooser: Chooser | None = None,
    trace: bool = False,
    max_steps: int = 400,
) -> Outcome:
    """Run ``scenario`` under the given completion decisions; never raises."""
    outcome = Outcome()
    policy = DecisionPolicy(decisions, max_hold=scenario.max_hold_steps, chooser=chooser)
    pool = BlockPool(scenario.num_blocks, scenario.block_size)
    config = SchedulerConfig(
        block_size=scenario.block_size,
        blocks_per_chunk=scenario.blocks_per_chunk,
        world_size=scenario.world_size,
        max_deferral_steps=scenario.max_deferral_steps,
        # Logical time: one second per engine step, so the bound in seconds also
        # covers idle steps (those the busy-step bound does not count).
        max_deferral_seconds=float(scenario.max_deferral_steps),
        direct_tier_loads=scenario.tier_loads == "direct",
        testing_disable_inflight_deferral=scenario.options.get("disable_deferral", False),
    )
    directory = Directory(scenario.num_slots, policy=scenario.eviction)
    lower = directory_tiers({"disk": scenario.lower_tier_slots}, scenario.eviction)
    epochs = [b""]

    def new_epoch() -> bytes:  # deterministic epochs: reproducible runs
        epochs.append(f"epoch-{len(epochs)}".encode())
        return epochs[-1]

    scheduler = build_scheduler(
        config,
        directory,
        NAMESPACE,
        lower,
        spill_after_hits=scenario.spill_after_hits,
        clock=lambda: float(scheduler.step),
        new_epoch=new_epoch,
    )
    worker = ManualWorker(pool, scenario.num_slots, world_size=scenario.world_size, policy=policy)
    engine = ReferenceEngine(
        EngineConfig(
            num_blocks=scenario.num_blocks,
            block_size=scenario.block_size,
            token_budget=scenario.token_budget,
            max_running=scenario.max_running,
            vocab=VOCAB,
            mode=scenario.mode,
            enable_prefix_caching=scenario.prefix_caching,
        ),
        scheduler,
        StepRunner(worker),
        pool,
    )
    worker.expected = Oracle(engine, NAMESPACE, scenario.blocks_per_chunk, epochs).expected
    if trace:
        _install_tracer(scheduler, worker, outcome.trace)
    last_arrival = max((r.arrival_step for r in scenario.requests), default=0)
    try:
        step = 0
        while True:
            for spec in scenario.requests:
                if spec.arrival_step == step:
                    engine.add_request(
                        spec.request_id, list(spec.prompt), spec.max_tokens, spec.salt
                    )
                    outcome.trace.append(f"  + {spec.request_id} arrives") if trace else None
                if spec.abort_step == step:
                    engine.abort(spec.request_id)
                    outcome.trace.append(f"  ! {spec.request_id} aborted") if trace else None
            if step in scenario.reset_steps:
                scheduler.reset()
                outcome.trace.append("  ! kvoffload cache reset") if trace else None
            if step > last_arrival and engine.idle:
                break
            if step >= max_steps:
                raise InvariantViolation(f"not finished after {max_steps} steps (starvation)")
            engine.step()
            scheduler.check_integrity()
            step += 1
        engine.drain()
        _check_quiescent(engine, scheduler, directory)
        _check_outputs(engine, scenario)
    except InvariantViolation as exc:
        outcome.violation, outcome.category = str(exc), _category(str(exc))
    except Exception as exc:
        outcome.violation = f"{type(exc).__name__}: {exc}"
        found = _category(str(exc))
        outcome.category = f"crash ({type(exc).__name__})" if found == "invariant" else found
    outcome.steps = engine.steps
    outcome.decisions = list(policy.record)
    outcome.branch_steps = list(policy.branch_steps)
    outcome.preemptions = engine.preemptions
    outcome.loads = scheduler.stats.loads
    outcome.stores = scheduler.stats.stores
    outcome.deferrals = sum(scheduler.metrics.breakdown("deferrals_total", "reason").values())
    return outcome


def _check_quiescent(
    engine: ReferenceEngine, scheduler: OffloadScheduler, d: HostDirectory
) -> None:
    problems = []
    if d.pinned_count:
        problems.append(f"{d.pinned_count} pins")
    if d.storing_count:
        problems.append(f"{d.storing_count} slots STORING")
    if scheduler.jobs_in_flight():
        problems.append(f"{len(scheduler.jobs_in_flight())} jobs in flight")
    if scheduler.request_ids():
        problems.append(f"states of {scheduler.request_ids()}")
    leaked = [b for b, r in enumerate(engine.pool.ref) if r]
    if leaked:
        problems.append(f"engine blocks {leaked} still referenced")
    if problems:
        raise InvariantViolation("not quiescent at the end: " + ", ".join(problems))


def _check_outputs(engine: ReferenceEngine, scenario: Scenario) -> None:
    for spec in scenario.requests:
        req = engine.requests[spec.request_id]
        if req.status is Status.ABORTED:
            continue
        if req.status is not Status.FINISHED:
            raise InvariantViolation(f"{spec.request_id} ended {req.status.value}")
        want = reference_outputs(spec.prompt, spec.max_tokens, VOCAB)
        if req.output != want:
            raise InvariantViolation(
                f"wrong tokens for {spec.request_id}: {req.output} instead of {want}"
            )


def _install_tracer(scheduler: OffloadScheduler, worker: ManualWorker, log: list[str]) -> None:
    build_plan, poll, lookup = scheduler.build_plan, worker.poll, scheduler.lookup

    def traced_lookup(request: EngineRequest, num_computed_tokens: int) -> int | None:
        answer = lookup(request, num_computed_tokens)
        jobs = sorted(job.job_id for job in scheduler.jobs_of(request.request_id))
        log.append(
            f"  lookup {request.request_id} (local hit {num_computed_tokens}, jobs in flight "
            f"{jobs}) -> {'retry later' if answer is None else answer}"
        )
        return answer

    def traced_plan(step: StepInput) -> StepPlan:
        plan = build_plan(step)
        sched = ", ".join(
            f"{s.request_id}[{s.num_computed_tokens}+{s.num_scheduled_tokens}]"
            for s in step.scheduled
        )
        log.append(f"step {plan.step}: scheduled {sched or '-'}; preempted {list(step.preempted)}")
        for job in (*plan.loads, *plan.stores):
            below = f" ({len(job.tier_chunks())} from tier {job.tier})" if job.tier else ""
            log.append(
                f"    {job.kind.value} job {job.job_id} {job.request_id}: "
                f"{len(job.keys)} chunks{below}, blocks {list(job.block_ids)}"
            )
        for move in (*plan.spills, *plan.promotions):
            log.append(
                f"    {move.kind.value} job {move.job_id} {move.request_id or '-'}: "
                f"{len(move.keys)} chunks, tier {move.tier}, host slots {list(move.slots)}"
            )
        if plan.flush:
            log.append(f"    flush {sorted(plan.flush)}")
        return plan

    def traced_poll() -> list[WorkerReport]:
        reports = poll()
        done = [f"{r.job_id}{'' if r.success else ' FAILED'}" for r in reports[0].results]
        if done:
            log.append(f"    worker reports {', '.join(done)}")
        return reports

    scheduler.build_plan = traced_plan  # type: ignore[method-assign]
    scheduler.lookup = traced_lookup  # type: ignore[method-assign]
    worker.poll = traced_poll  # type: ignore[method-assign]
