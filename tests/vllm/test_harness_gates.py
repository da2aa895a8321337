"""The harness's gates: what is released can always be waited for; tier loads' tier
halves are held, failed and faulted like tier jobs."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path

from kvoffload.core.failures import error_failure
from kvoffload.core.jobs import NO_SLOT, EngineJob, JobKind
from kvoffload.core.keys import ChunkKey
from kvoffload.testing.vllm_fuzz.__main__ import main as fuzz
from kvoffload.testing.vllm_fuzz.faults import FaultPolicy
from kvoffload.testing.vllm_fuzz.scenario import Fault, FaultKind, random_scenario
from kvoffload.testing.vllm_harness.gates import CopyGate, GatedTiers
from kvoffload.tiers.disk import DiskStore
from kvoffload.tiers.disk_store import DiskTierStore
from kvoffload.transfer import TransferWorker
from kvoffload.transfer.staged_loads import StagedLoads
from kvoffload.transfer.tier_worker import TierStore


def store(job_id: int) -> EngineJob:
    key = ChunkKey(job_id.to_bytes(16, "big"))
    return EngineJob(job_id, JobKind.STORE, "r", (key,), (job_id,), (job_id,), 1)


def passes(gate: CopyGate, job: EngineJob) -> bool:
    """Whether ``job`` gets through the gate within a second (a lane thread's view)."""
    through = threading.Event()
    thread = threading.Thread(target=lambda: (gate(job), through.set()), daemon=True)
    thread.start()
    return through.wait(1.0)


def test_a_job_released_before_it_is_submitted_releases_its_lane_predecessors() -> None:
    """Found by the fuzzer (seed 20001, async, every store slow): a store planned and
    flushed in the same step is released before the worker submits it; the slow
    store ahead of it in its lane stayed held and the flush waited forever."""
    gate = CopyGate()
    held = store(1)
    gate.submitted(held)
    assert not passes(gate, store(99))  # nothing released: a job waits
    gate.release([2])  # the flush of job 2, not submitted yet
    gate.submitted(store(2))
    assert passes(gate, held)  # the lane can reach job 2
    assert passes(gate, store(2))


def test_the_seed_that_hung_passes() -> None:
    """Should it hang again, the fuzzer's watchdog ends the test run with status 3 and
    every thread's stack rather than stalling it."""
    args = ["--seeds", "1", "--start", "20001", "--scheduler", "async", "-q"]
    assert fuzz([*args, "--schedule-timeout", "120"]) == 0


def test_gated_staged_loads_hold_fail_and_release_tier_loads(tmp_path: Path) -> None:
    """A tier load's tier half waits in the gate like a tier job: held until the
    policy releases it, failed unstarted as a tier that failed as a whole."""
    import torch

    engine = torch.zeros(16, 64, dtype=torch.uint8)
    worker = TransferWorker.for_kv_caches(
        {"l": engine}, 16, blocks_per_chunk=1, host_budget_bytes=4 * 64
    )
    stores: dict[str, TierStore] = {"disk": DiskTierStore(DiskStore(tmp_path, bytes(16), 0, 64, 4))}
    staged = StagedLoads.open(worker, stores)
    gated: GatedTiers[EngineJob] = GatedTiers(staged)
    try:
        key = ChunkKey(bytes(range(16)))
        payload = memoryview(bytearray(b"\x07" * 64))
        assert stores["disk"].write_many([(key, payload)], [2]) == [None]
        loads = [
            EngineJob(
                i, JobKind.LOAD, "r", (key,), (NO_SLOT,), (i,), 1, tier="disk", tier_slots=(2,)
            )
            for i in (1, 2)
        ]
        for job in loads:
            gated.submit(job)
        assert gated.running() == {1, 2} and staged.running() == set()  # held: not started
        gated.fail([1])
        assert gated.release([2]) == {2}
        assert gated.inner.wait([2], timeout=30)
        results = {r.job_id: r for r in gated.poll()}
        assert not results[1].success
        assert results[1].failed_chunks == ((0, error_failure("injected tier failure")),)
        assert results[2].success and bytes(engine[2].numpy()) == b"\x07" * 64
        assert bytes(engine[1].numpy()) == bytes(64)  # the failed one wrote nothing
    finally:
        gated.shutdown()
        stores["disk"].close()  # type: ignore[attr-defined]
        worker.shutdown()


def test_tier_faults_fail_and_slow_tier_loads_but_never_hang_them() -> None:
    scenario = random_scenario(7, async_scheduling=False, redis=False)
    load = EngineJob(
        5, JobKind.LOAD, "r", (ChunkKey(bytes(16)),), (NO_SLOT,), (3,), 1, tier="disk",
        tier_slots=(0,),
    )  # fmt: skip
    hang = FaultPolicy(replace(scenario, faults=(Fault(FaultKind.HANG_TIER, rate=1.0),)))
    assert hang.tier_jobs(0, 1, [load]) == ({5}, set())
    fail = FaultPolicy(replace(scenario, faults=(Fault(FaultKind.FAIL_TIER, rate=1.0),)))
    assert fail.tier_jobs(0, 1, [load]) == (set(), {5})
    assert fail.injected["failed_tier_load"] == 1
    slow = FaultPolicy(replace(scenario, faults=(Fault(FaultKind.SLOW_TIER, rate=1.0, steps=1),)))
    assert slow.tier_jobs(0, 1, [load]) == (set(), set())
    assert slow.tier_jobs(0, 2, [load]) == ({5}, set())
