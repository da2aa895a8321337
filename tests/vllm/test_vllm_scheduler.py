"""kvoffload's connector on vLLM's real Scheduler and AsyncScheduler, step by step,
with transfers completing only when the test says."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload.core.errors import ConfigError
from kvoffload.testing.vllm_harness import VllmHarness

PREFIX = list(range(10, 74))  # 64 tokens: 4 blocks of 16
MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]


@pytest.fixture
def make(tiny_model: Path) -> Iterator:  # type: ignore[type-arg]
    made: list[VllmHarness] = []

    def build(**kwargs: object) -> VllmHarness:
        h = VllmHarness(tiny_model, **kwargs)  # type: ignore[arg-type]
        made.append(h)
        return h

    yield build
    for h in made:
        h.close()


def deferrals(h: VllmHarness) -> int:
    return h.scheduler_half.metrics.value("deferrals_total", reason="transfer_in_flight")


def quiescent(h: VllmHarness) -> None:
    half = h.scheduler_half
    assert half.jobs_in_flight() == [] and half.request_ids() == []
    assert half.directory.pinned_count == 0 and half.directory.storing_count == 0
    half.check_integrity()
    pool = h.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1  # block 0 is vLLM's null block


def test_seed_scenario_on_the_async_scheduler(make) -> None:  # type: ignore[no-untyped-def]
    """Pending stores; a preemption flushes them; the next step is scheduled before
    the output acknowledging the flush is consumed: the re-admission is deferred, no
    load job is emitted, nothing asserts; once drained, the request finishes right."""
    h = make(async_scheduling=True, num_blocks=10)
    h.add_request("a", PREFIX, max_tokens=8)
    h.add_request("b", list(range(100, 164)), max_tokens=8)
    for _ in range(10):
        record = h.step(complete=False)  # every store stays in flight
        if "b" in record.preempted:
            break
    else:
        pytest.fail("b was never preempted")
    b_stores = {j.job_id for r in h.steps for j in r.plan.stores if j.request_id == "b"}
    assert b_stores and b_stores <= record.plan.flush
    before = deferrals(h)
    readmit = h.step(complete=False)  # output of the preemption step not consumed yet
    assert deferrals(h) > before
    assert readmit.loads_for("b") == [] and "b" not in readmit.scheduled
    h.run()
    assert h.scheduler_half.metrics.value("deferral_timeouts_total") == 0
    quiescent(h)


def test_sync_scheduler_acknowledges_the_flush_before_readmission(make) -> None:  # type: ignore[no-untyped-def]
    h = make(async_scheduling=False, num_blocks=10)
    h.add_request("a", PREFIX, max_tokens=8)
    h.add_request("b", list(range(100, 164)), max_tokens=8)
    h.run()
    assert any("b" in r.preempted for r in h.steps)
    assert deferrals(h) == 0
    quiescent(h)


@pytest.mark.parametrize("async_scheduling", MODES)
def test_load_after_a_prefix_cache_miss(make, async_scheduling: bool) -> None:  # type: ignore[no-untyped-def]
    h = make(async_scheduling=async_scheduling)
    h.add_request("a", PREFIX, max_tokens=3)
    h.run()
    h.scheduler.reset_prefix_cache()
    h.add_request("b", [*PREFIX, 5, 6, 7], max_tokens=3)
    h.run()
    loads = [j for r in h.steps for j in r.loads_for("b")]
    assert len(loads) == 1 and len(loads[0].keys) == 4
    assert h.loads_checked == 1  # the loaded blocks hold exactly b's KV
    assert h.scheduler_half.metrics.value("hit_tokens_total", tier="host") == 64
    quiescent(h)


@pytest.mark.parametrize("async_scheduling", MODES)
def test_concurrent_requests_sharing_a_prefix_both_load_at_once(
    make, async_scheduling: bool
) -> None:  # type: ignore[no-untyped-def]
    h = make(async_scheduling=async_scheduling)
    h.add_request("a", PREFIX, max_tokens=2)
    h.run()
    h.scheduler.reset_prefix_cache()
    h.add_request("b", [*PREFIX, 1, 2], max_tokens=2)
    h.add_request("c", [*PREFIX, 3, 4], max_tokens=2)
    record = h.step(complete=False)
    assert {j.request_id for j in record.plan.loads} == {"b", "c"}  # no convoy
    assert h.scheduler_half.directory.pinned_count == 8
    h.run()
    assert h.loads_checked == 2
    quiescent(h)


@pytest.mark.parametrize("async_scheduling", MODES)
def test_abort_while_loading(make, async_scheduling: bool) -> None:  # type: ignore[no-untyped-def]
    h = make(async_scheduling=async_scheduling)
    h.add_request("a", PREFIX, max_tokens=2)
    h.run()
    h.scheduler.reset_prefix_cache()
    h.add_request("b", PREFIX, max_tokens=2)
    record = h.step(complete=False)
    assert record.loads_for("b")
    h.abort("b")
    h.step(complete=False)
    h.run()
    quiescent(h)


@pytest.mark.parametrize("async_scheduling", MODES)
def test_abort_while_storing(make, async_scheduling: bool) -> None:  # type: ignore[no-untyped-def]
    h = make(async_scheduling=async_scheduling)
    h.add_request("a", PREFIX, max_tokens=8)
    record = h.step(complete=False)
    assert record.plan.stores
    h.abort("a")
    h.add_request("b", list(range(200, 264)), max_tokens=2)  # reuses a's freed blocks
    h.run()
    quiescent(h)
    # a's stores captured a's KV before b overwrote the blocks: a repeat loads it right.
    h.scheduler.reset_prefix_cache()
    h.add_request("a2", PREFIX, max_tokens=2)
    h.run()
    assert h.loads_checked == 1


@pytest.mark.parametrize("async_scheduling", MODES)
def test_a_failed_load_is_recomputed(make, async_scheduling: bool) -> None:  # type: ignore[no-untyped-def]
    h = make(async_scheduling=async_scheduling)
    h.add_request("a", PREFIX, max_tokens=2)
    h.run()
    h.scheduler.reset_prefix_cache()
    h.add_request("b", PREFIX, max_tokens=2)
    record = h.step(complete=False)
    (load,) = record.loads_for("b")
    failed = h.step(complete=False, fail={load.job_id})
    assert failed.invalid_blocks == set(load.block_ids)
    h.run()
    assert h.scheduler_half.stats.load_failures == 1
    computed = sum(r.scheduled.get("b", 0) for r in h.steps)
    assert computed >= len(PREFIX)  # the prompt was recomputed, not taken from the bad load
    assert h.connector._kv_transfer_config.kv_load_failure_policy == "recompute"
    quiescent(h)


@pytest.mark.parametrize("async_scheduling", MODES)
def test_a_failed_store_frees_its_slots(make, async_scheduling: bool) -> None:  # type: ignore[no-untyped-def]
    h = make(async_scheduling=async_scheduling)
    h.add_request("a", PREFIX, max_tokens=2)
    record = h.step(complete=False)
    (store,) = record.plan.stores
    h.step(complete=False, fail={store.job_id})
    h.run()
    assert h.scheduler_half.stats.store_failures == 1
    assert h.scheduler_half.directory.used_slots == 0
    h.scheduler.reset_prefix_cache()
    h.add_request("b", PREFIX, max_tokens=2)
    h.run()
    assert h.loads_checked == 0
    quiescent(h)


def test_bad_extra_config_fails_at_start(tiny_model: Path) -> None:
    with pytest.raises(ConfigError, match="cpu_byts.*valid keys"):
        VllmHarness(tiny_model, extra={"cpu_byts": 5})
    with pytest.raises(ConfigError, match="eviction.*accepted: arc | lru | s3fifo"):
        VllmHarness(tiny_model, extra={"eviction": "random"})
    with pytest.raises(ConfigError, match="chunk_tokens.*multiple of the engine block size 16"):
        VllmHarness(tiny_model, extra={"chunk_tokens": 24})
