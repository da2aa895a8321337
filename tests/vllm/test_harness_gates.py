"""The harness's copy gate: what is released can always be waited for."""

from __future__ import annotations

import threading

from kvoffload.core.jobs import EngineJob, JobKind
from kvoffload.core.keys import ChunkKey
from kvoffload.testing.vllm_fuzz.__main__ import main as fuzz
from kvoffload.testing.vllm_harness.gates import CopyGate


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
