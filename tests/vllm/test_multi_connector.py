"""kvoffload inside vLLM's ``MultiConnector``, beside another loading connector (the
P/D shape), on vLLM's real scheduler: the harness runs two kvoffload connectors, the
other first (it loads whenever it has a hit, into blocks of the engine's choosing),
kvoffload under test second, and checks both and every forward pass."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvoffload.adapters.vllm import load_failure
from kvoffload.core.jobs import JobKind, TransferJob
from kvoffload.testing.vllm_harness import CompleteAll, VllmHarness
from kvoffload.testing.vllm_harness.checks import HarnessViolation
from kvoffload.testing.vllm_harness.spec import HEAD_SIZE, HEADS, LAYERS

MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]
BLOCK = 16
CHUNK_BYTES = len(LAYERS) * HEADS * BLOCK * 2 * HEAD_SIZE * 4  # one block, all layers
DOC = list(range(10, 74))  # 64 tokens: 4 chunks of one block
OTHER = list(range(300, 364))


@dataclass
class HoldStores(CompleteAll):
    """Loads complete at once; store copies wait while ``hold`` is on (a busy copy
    stream), unless a plan flushes them."""

    hold: bool = True

    def copies(
        self, rank: int, step: int, jobs: Sequence[TransferJob]
    ) -> tuple[set[int], set[int]]:
        return {j.job_id for j in jobs if not (self.hold and j.kind is JobKind.STORE)}, set()


def steps_until_finished(h: VllmHarness, request_id: str, limit: int = 60) -> None:
    for _ in range(limit):
        if request_id not in h.scheduler.requests:
            return
        h.step()
    raise AssertionError(f"{request_id} still running after {limit} steps")


@pytest.mark.parametrize("async_scheduling", MODES)
def test_the_recompute_policy_is_in_force_where_vllm_reads_it(
    make: Any, async_scheduling: bool
) -> None:
    """MultiConnector hands each child a copy of the config; vLLM's scheduler reads
    the top-level policy (default ``fail``). kvoffload sets it there, and a failed
    load of kvoffload's under MultiConnector is recomputed, not a failed request."""
    h = make(
        async_scheduling=async_scheduling,
        beside={"cpu_bytes": CHUNK_BYTES},  # one chunk: the other connector never hits
    )
    assert type(h.scheduler.connector).__name__ == "MultiConnector"
    assert h.scheduler.vllm_config.kv_transfer_config.kv_load_failure_policy == "recompute"
    assert h.scheduler.recompute_kv_load_failures
    h.add_request("a", DOC, max_tokens=2)
    h.run()
    h.scheduler.reset_prefix_cache()
    h.add_request("b", DOC + [5], max_tokens=2)
    record = h.step(complete=False)
    (load,) = record.loads_for("b")  # kvoffload under test loads: the other has no hit
    assert not any(j.request_id == "b" for p in record.beside for j in p.loads)
    failed = h.step(complete=False, fail={load.job_id})
    assert failed.invalid_blocks == set(load.block_ids)
    h.run()
    assert h.output_tokens("b") == h.model.reference_output("b", DOC + [5], 2)
    assert h.scheduler_half.stats.load_failures == 1
    h.quiescent()


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_the_start_up_line_names_the_policy_it_set(make: Any) -> None:
    """The scheduler role's start-up line says where the policy was set, alone and
    under MultiConnector. (Read on the ``kvoffload`` logger itself: once attached to
    vLLM's logging it does not propagate to the root logger.)"""
    captured, kvoffload_logger = _Lines(), logging.getLogger("kvoffload")
    kvoffload_logger.addHandler(captured)
    level = kvoffload_logger.level
    kvoffload_logger.setLevel(logging.INFO)
    try:
        make()
        make(beside={"cpu_bytes": 1 << 20})
    finally:
        kvoffload_logger.removeHandler(captured)
        kvoffload_logger.setLevel(level)
    lines = [line for line in captured.lines if "kv_load_failure_policy=" in line]
    policies = [line.split("kv_load_failure_policy=")[1].split(", metrics")[0] for line in lines]
    assert policies[0] == "recompute (set by kvoffload; was 'fail')"
    # Under MultiConnector: both children set it on the engine's config; the first
    # found 'fail' there, the second finds it already in force.
    assert policies[1:] == [
        "recompute (set by kvoffload on MultiConnector's kv_transfer_config; was 'fail')",
        "recompute (MultiConnector's)",
    ]
    assert load_failure.PolicyOutcome("fail", 0).describe() == policies[0]


@pytest.mark.parametrize("async_scheduling", MODES)
def test_a_block_another_connector_loads_is_fresh_to_kvoffload(
    make: Any, async_scheduling: bool
) -> None:
    """The other connector serves request r2 a hit into blocks r1 just freed while
    kvoffload's store of r1 still reads them (a busy copy stream). kvoffload got
    ``update_state_after_alloc(r2, blocks, 0)`` and must treat every block past the
    engine's own hit as fresh: its store is flushed before the other's load lands.
    Before, the harness caught the store reading overwritten blocks (and kvoffload
    then stored r2's KV under r1's keys)."""
    h = make(async_scheduling=async_scheduling, num_blocks=7, beside={"cpu_bytes": 1 << 20})
    h.add_request("p", DOC, max_tokens=2)
    h.run()  # both connectors hold DOC
    h.scheduler.reset_prefix_cache()
    h.policy = HoldStores()
    h.add_request("r1", OTHER, max_tokens=2)
    steps_until_finished(h, "r1")
    held = {
        b
        for j in h.side.scheduler.jobs_in_flight()
        if j.kind is JobKind.STORE and j.request_id == "r1"
        for b in j.block_ids
    }
    assert held, "kvoffload's stores of r1 are still in flight"
    h.add_request("r2", DOC + [5], max_tokens=2)
    record = h.step()
    while not record or (not record.scheduled and not any(p.loads for p in record.beside)):
        record = h.step()
    (other_load,) = [j for p in record.beside for j in p.loads if j.request_id == "r2"]
    assert not record.loads_for("r2")  # the other connector serves r2, not kvoffload
    assert held & set(other_load.block_ids), "the other's load lands in r1's freed blocks"
    assert record.plan.flush, "kvoffload flushes its store of r1 first"
    h.policy = CompleteAll()
    h.run()
    assert h.output_tokens("r2") == h.model.reference_output("r2", DOC + [5], 2)
    # kvoffload's copy of r1 holds r1's KV: a repeat served from it reads right.
    h.scheduler.reset_prefix_cache()
    h.add_request("r1-again", OTHER, max_tokens=2)
    h.run()
    assert h.output_tokens("r1-again") == h.model.reference_output("r1-again", OTHER, 2)
    h.quiescent()


def test_without_the_fresh_fence_the_harness_catches_the_overwrite(
    make: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same schedule with the allocation's fence taken out fails the harness's
    check: the check can fail, and it is this fence that keeps it green."""
    from kvoffload.core.scheduler.step_builder import StepBuilder

    monkeypatch.setattr(StepBuilder, "add_allocation", lambda self, blocks, held: None)
    h = make(num_blocks=7, beside={"cpu_bytes": 1 << 20})
    h.add_request("p", DOC, max_tokens=2)
    h.run()
    h.scheduler.reset_prefix_cache()
    h.policy = HoldStores()
    h.add_request("r1", OTHER, max_tokens=2)
    steps_until_finished(h, "r1")
    h.add_request("r2", DOC + [5], max_tokens=2)
    with pytest.raises(HarnessViolation, match="still reads blocks"):
        for _ in range(10):
            h.step()


@pytest.mark.parametrize(
    ("seed", "async_scheduling"), [(41, False), (172, False), (227, True), (1424, False)]
)
def test_a_request_the_engine_cannot_admit_while_idle_never_stalls_it(
    tiny_model: Path, seed: int, async_scheduling: bool
) -> None:
    """Found by the fuzzer (MultiConnector seeds, and 227 with hung tier I/O alone):
    a request whose load failed is
    re-queued at the head of vLLM's queue of block holders; the engine could not
    allocate it (with kvoffload's hit, or without one on a hybrid model), so every
    step stopped at it and the request behind it, whose load had landed, never ran
    (nothing else would free blocks). Now a request the engine did not admit while
    it ran nothing is answered retry-later every other time (vLLM skips it and serves
    those behind it); a hit is dropped past the deferral bound."""
    from kvoffload.testing.vllm_fuzz.runner import Environment, run_scenario
    from kvoffload.testing.vllm_fuzz.scenario import random_scenario

    env = Environment(tiny_model)
    try:
        scenario = random_scenario(seed, async_scheduling=async_scheduling)
        outcome = run_scenario(scenario, env)
    finally:
        env.close()
    assert not outcome.failed, outcome.message
    assert outcome.stats["deferrals"] > 0 and outcome.stats["requests_checked"] > 0
