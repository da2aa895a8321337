"""The reference engine with and without kvoffload, and the upstream async regression."""

from __future__ import annotations

import pytest

from kvoffload.core.directory import Directory
from kvoffload.core.scheduler import OffloadScheduler
from kvoffload.core.scheduler_types import SchedulerConfig
from kvoffload.core.step_runner import StepRunner
from kvoffload.engine.engine import ReferenceEngine
from kvoffload.engine.manual_worker import ManualWorker
from kvoffload.engine.model import reference_outputs
from kvoffload.engine.settings import EngineConfig, StepMode
from kvoffload.testing.explorer import seed_race_scenario, tier_scenario
from kvoffload.testing.policies import Choice
from kvoffload.testing.run import NAMESPACE, run_schedule

VOCAB = 1000


def engine(mode: StepMode, offload: bool, num_blocks: int = 12, caching: bool = True):  # type: ignore[no-untyped-def]
    config = EngineConfig(
        num_blocks=num_blocks,
        block_size=4,
        token_budget=12,
        max_running=3,
        vocab=VOCAB,
        mode=mode,
        enable_prefix_caching=caching,
    )
    if not offload:
        return ReferenceEngine(config)
    from kvoffload.engine.block_pool import BlockPool

    pool = BlockPool(num_blocks, 4)
    scheduler = OffloadScheduler(SchedulerConfig(block_size=4), Directory(64), NAMESPACE)
    return ReferenceEngine(config, scheduler, StepRunner(ManualWorker(pool, 64)), pool)


def run_to_end(e: ReferenceEngine, limit: int = 500) -> None:
    assert e.run_until_idle(limit)


PROMPTS = {
    "a": list(range(10, 30)),
    "b": list(range(10, 22)) + [5, 6, 7, 8, 9],
    "c": list(range(10, 30)) + [40, 41],
    "d": [99, 98, 97, 96, 95, 94, 93],
}


@pytest.mark.parametrize("mode", list(StepMode))
@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("caching", [True, False])
def test_outputs_equal_the_reference_model_under_preemption(
    mode: StepMode, offload: bool, caching: bool
) -> None:
    e = engine(mode, offload, num_blocks=9, caching=caching)
    for rid, prompt in PROMPTS.items():
        e.add_request(rid, prompt, max_tokens=5)
    run_to_end(e)
    assert e.preemptions > 0  # the pool is small enough to force recompute
    for rid, prompt in PROMPTS.items():
        assert e.requests[rid].output == reference_outputs(prompt, 5, VOCAB)


def test_a_repeated_prompt_is_loaded_from_kvoffload_and_matches() -> None:
    e = engine(StepMode.SYNC, offload=True, caching=False)
    e.add_request("first", PROMPTS["a"], max_tokens=3)
    run_to_end(e)
    e.add_request("again", PROMPTS["a"], max_tokens=3)
    run_to_end(e)
    assert e.scheduler is not None and e.scheduler.stats.loads == 1
    assert e.scheduler.metrics.value("hit_tokens_total", tier="host") == 20
    assert e.requests["again"].output == e.requests["first"].output


def test_async_preempt_readmit_before_transfer_output_is_deferred() -> None:
    """Pending stores, a preemption, the request scheduled again before the output
    acknowledging the flushed store is applied: the re-admission is deferred, no
    load job is emitted, nothing raises; once drained, it loads and finishes right."""
    scenario = seed_race_scenario()
    outcome = run_schedule(scenario, (Choice.ALL, Choice.ALL, Choice.ALL, Choice.NONE), trace=True)
    assert outcome.violation is None, outcome.violation
    trace = outcome.trace
    deferred = next(
        i for i, line in enumerate(trace) if line.startswith("  lookup second") and "[4]" in line
    )
    assert trace[deferred].endswith("-> retry later")
    step_line = next(i for i in range(deferred, len(trace)) if trace[i].startswith("step "))
    step_end = next(i for i in range(step_line + 1, len(trace)) if not trace[i].startswith("    "))
    assert not any("load job" in line for line in trace[step_line:step_end])
    readmitted = next(
        line for line in trace[deferred:] if line.startswith("  lookup second") and "[]" in line
    )
    assert not readmitted.endswith("-> 0") and not readmitted.endswith("retry later")
    assert any("load job" in line and "second" in line for line in trace[deferred:])
    assert outcome.deferrals >= 1


def test_aborts_and_a_reset_mid_run_leave_nothing_behind() -> None:
    e = engine(StepMode.BATCH_QUEUE, offload=True, num_blocks=9)
    for rid, prompt in PROMPTS.items():
        e.add_request(rid, prompt, max_tokens=4)
    e.step()
    e.abort("b")
    e.step()
    assert e.scheduler is not None
    e.scheduler.reset()
    e.abort("c")
    run_to_end(e)
    assert e.scheduler.directory.pinned_count == 0
    assert e.scheduler.jobs_in_flight() == []
    assert e.requests["a"].output == reference_outputs(PROMPTS["a"], 4, VOCAB)
    assert e.requests["d"].output == reference_outputs(PROMPTS["d"], 4, VOCAB)


def test_a_prefix_pushed_below_host_memory_is_loaded_straight_from_the_tier() -> None:
    outcome = run_schedule(tier_scenario(), trace=True)
    assert outcome.violation is None, outcome.violation
    trace = "\n".join(outcome.trace)
    assert "spill job" in trace and "promote job" not in trace
    assert "lookup again (local hit 0, jobs in flight []) -> 16" in trace
    assert "from tier disk" in trace.split("-> 16")[1]


def test_a_prefix_pushed_below_host_memory_is_promoted_then_loaded() -> None:
    outcome = run_schedule(tier_scenario(tier_loads="promote"), trace=True)
    assert outcome.violation is None, outcome.violation
    trace = "\n".join(outcome.trace)
    assert "spill job" in trace and "promote job" in trace
    assert "lookup again (local hit 0, jobs in flight []) -> 16" in trace
    assert "load job" in trace.split("-> 16")[1]
