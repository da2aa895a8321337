"""A worker's sleep mode (``adapters/vllm/sleep_state.py``, decision 0021): unregister
fences the copiers and drains the copies submitted before; while asleep every copy
fails at once with ASLEEP; restore maps the KV caches again and lifts the fence; both
calls are idempotent. No sleeps: copies are held by a :class:`Gate`.
"""

from __future__ import annotations

import threading

import pytest
import torch
from kv_engines import Gate, job, record, vllm_cpu

from kvoffload.adapters.vllm.sleep_state import TRANSITIONS, SleepPhase, WorkerSleep
from kvoffload.core.jobs import ASLEEP, JobKind, JobResult
from kvoffload.transfer import TransferWorker

N, K, SLOTS = 64, 2, 32
BUDGET = SLOTS * K * 3 * 256  # vllm_cpu: 3 layers of 256-byte pages
STORE, LOAD = JobKind.STORE, JobKind.LOAD


def results(worker: TransferWorker) -> dict[int, JobResult]:
    return {r.job_id: r for r in worker.poll()}


def test_unregister_waits_for_engine_copies_and_fences_new_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = vllm_cpu(N)
    gate = Gate(hold=[1, 2])
    worker = TransferWorker.for_kv_caches(
        engine.caches, N, blocks_per_chunk=K, host_budget_bytes=BUDGET, hook=gate
    )
    worker.submit_store(job(1, STORE, [0], [0, 1], K))  # reads engine blocks
    worker.submit_load(job(2, LOAD, [1], [2, 3], K))  # writes engine blocks
    gate.wait_started(1)
    gate.wait_started(2)
    draining = threading.Event()
    drain = worker.drain

    def noted_drain(*, collect: bool = True) -> None:
        draining.set()  # the fence is up by now
        drain(collect=collect)

    monkeypatch.setattr(worker, "drain", noted_drain)
    sleep = WorkerSleep()
    thread = threading.Thread(target=sleep.unregister, args=([(worker, True)], ()))
    thread.start()
    assert draining.wait(Gate.TIMEOUT)
    assert sleep.phase is SleepPhase.DRAINING
    worker.submit_store(job(3, STORE, [2], [4, 5], K))  # after the fence: refused at once
    worker.submit_load(job(4, LOAD, [3], [6, 7], K))
    thread.join(0.1)
    assert thread.is_alive()  # held copies 1 and 2 are still running
    gate.release(1)
    thread.join(0.1)
    assert thread.is_alive()  # the load still writes engine blocks
    gate.release(2)
    thread.join(Gate.TIMEOUT)
    assert not thread.is_alive() and sleep.phase is SleepPhase.ASLEEP
    done = results(worker)
    assert done[1].success and done[2].success
    assert not done[3].success and done[3].error == ASLEEP
    assert not done[4].success and done[4].error == ASLEEP
    assert sorted(gate.seen) == [1, 2]  # the refused jobs never reached a copy
    assert sleep.refusal == ASLEEP
    worker.shutdown()


def test_both_calls_are_idempotent_and_restore_lifts_the_fence() -> None:
    engine = vllm_cpu(N)
    worker = TransferWorker.for_kv_caches(
        engine.caches, N, blocks_per_chunk=K, host_budget_bytes=BUDGET
    )
    sleep = WorkerSleep()
    sleep.restore([(worker, True)], engine.caches)  # awake: nothing to do
    assert sleep.phase is SleepPhase.AWAKE and sleep.refusal is None
    sleep.unregister([(worker, True)], ())
    sleep.unregister([(worker, True)], ())
    assert sleep.phase is SleepPhase.ASLEEP and sleep.sleeps == 1
    worker.submit_store(job(1, STORE, [0], [0, 1], K))
    worker.wait([1])
    assert results(worker)[1].error == ASLEEP
    sleep.restore([(worker, True)], engine.caches)
    sleep.restore([(worker, True)], engine.caches)
    assert sleep.phase is SleepPhase.AWAKE and sleep.refusal is None
    worker.submit_store(job(2, STORE, [0], [0, 1], K))
    worker.wait([2])
    assert results(worker)[2].success
    assert set(TRANSITIONS) == {
        (SleepPhase.AWAKE, SleepPhase.DRAINING),
        (SleepPhase.DRAINING, SleepPhase.ASLEEP),
        (SleepPhase.ASLEEP, SleepPhase.AWAKE),
    }
    worker.shutdown()


def test_after_wake_up_loads_write_the_engine_memory_given_back() -> None:
    """The memory is released (overwritten) while asleep; after restore a load copies
    the host chunk stored before the sleep into the views derived again."""
    engine = vllm_cpu(N)
    worker = TransferWorker.for_kv_caches(
        engine.caches, N, blocks_per_chunk=K, host_budget_bytes=BUDGET
    )
    want = record(engine, 0) + record(engine, 1)
    worker.submit_store(job(1, STORE, [0], [0, 1], K))
    worker.wait([1])
    sleep = WorkerSleep()
    sleep.unregister([(worker, True)], ())
    for tensor in engine.caches.values():
        tensor.view(torch.uint8).fill_(0xAB)  # vLLM reused the memory
    sleep.restore([(worker, True)], engine.caches)
    worker.submit_load(job(2, LOAD, [0], [10, 11], K))
    worker.wait([2])
    assert results(worker)[2].success
    assert record(engine, 10) + record(engine, 11) == want
    worker.shutdown()


def test_a_layout_that_changed_keeps_the_worker_asleep() -> None:
    engine = vllm_cpu(N)
    worker = TransferWorker.for_kv_caches(
        engine.caches, N, blocks_per_chunk=K, host_budget_bytes=BUDGET
    )
    sleep = WorkerSleep()
    sleep.unregister([(worker, True)], ())
    other = vllm_cpu(N, layers=2)
    sleep.restore([(worker, True)], other.caches)  # logged, never raised
    assert sleep.phase is SleepPhase.ASLEEP and sleep.refusal == ASLEEP
    sleep.restore([(worker, True)], engine.caches)  # not tried again
    assert sleep.phase is SleepPhase.ASLEEP
    worker.submit_store(job(1, STORE, [0], [0, 1], K))
    worker.wait([1])
    assert results(worker)[1].error == ASLEEP
    worker.shutdown()


def test_jobs_that_straddled_the_sleep_stay_refused_after_it() -> None:
    """A tier load still reading at unregister never copies into the engine: vLLM gave
    its blocks away."""
    engine = vllm_cpu(N)
    worker = TransferWorker.for_kv_caches(
        engine.caches, N, blocks_per_chunk=K, host_budget_bytes=BUDGET
    )
    sleep = WorkerSleep()
    sleep.unregister([(worker, True)], {7})
    sleep.restore([(worker, True)], engine.caches)
    worker.submit_load(job(7, LOAD, [0], [0, 1], K))
    worker.submit_load(job(8, LOAD, [1], [2, 3], K))
    worker.wait([7, 8])
    done = results(worker)
    assert done[7].error == ASLEEP and done[8].success
    worker.shutdown()
