"""The asynchronous worker: ordering, wait, shutdown, failures. No sleeps.

Copies are held and released through a :class:`Gate` hook, which runs on the copy
thread right before a job's copy; each direction runs its jobs in order, so holding
one store holds every later store while loads go on.
"""

from __future__ import annotations

import threading

import pytest
from kv_engines import Gate, job, record, vllm_cpu

from kvoffload.core.errors import ContractViolation
from kvoffload.core.jobs import EngineJob, JobKind, JobResult, WorkerReport
from kvoffload.transfer import TransferWorker

N, K, SLOTS = 64, 2, 32
BUDGET = SLOTS * K * 3 * 256  # vllm_cpu: 3 layers of 256-byte pages
STORE, LOAD = JobKind.STORE, JobKind.LOAD


def make_worker(gate: Gate | None = None, threads: int = 1) -> TransferWorker:
    engine = vllm_cpu(N)
    return TransferWorker.for_kv_caches(
        engine.caches, N, blocks_per_chunk=K, host_budget_bytes=BUDGET, threads=threads, hook=gate
    )


@pytest.fixture
def gate() -> Gate:
    return Gate()


def by_id(results: list[JobResult]) -> dict[int, JobResult]:
    ids = [r.job_id for r in results]
    assert len(ids) == len(set(ids)), f"a job was reported twice: {ids}"
    return {r.job_id: r for r in results}


@pytest.mark.parametrize("threads", [1, 2])
def test_many_jobs_in_flight_each_reported_once(threads: int) -> None:
    worker = make_worker(threads=threads)
    for job_id in range(1, 31):
        slot = job_id % SLOTS
        worker.submit_store(job(job_id, STORE, [slot], [2 * slot, 2 * slot + 1], K))
    worker.wait(range(1, 31))
    for job_id in range(31, 61):
        worker.submit_load(job(job_id, LOAD, [job_id - 31], [job_id - 31, 63 - (job_id - 31)], K))
    worker.wait(range(31, 61))
    results = by_id(worker.poll() + worker.poll())
    assert sorted(results) == list(range(1, 61))
    assert all(r.success and r.nbytes == K * 768 and r.seconds >= 0 for r in results.values())
    assert worker.poll() == []
    worker.shutdown()


def test_results_out_of_order_and_wait_on_a_subset() -> None:
    gate = Gate(hold=[1])
    worker = make_worker(gate)
    worker.submit_store(job(1, STORE, [0], [0, 1], K))
    worker.submit_store(job(2, STORE, [1], [2, 3], K))  # queued behind the held store
    gate.wait_started(1)
    for job_id in (3, 4, 5):
        worker.submit_load(job(job_id, LOAD, [job_id], [10 + 2 * job_id, 11 + 2 * job_id], K))
    worker.wait([5, 3, 999])  # a subset, plus an unknown id
    assert sorted(by_id(worker.poll())) == [3, 4, 5]
    gate.release(1)
    worker.wait([2])
    assert [r.job_id for r in worker.poll()] == [1, 2]
    worker.wait([1, 2, 3])  # already reported: returns at once
    worker.shutdown()


def test_failing_copy_is_a_failed_result_and_others_are_intact() -> None:
    engine = vllm_cpu(N)
    gate = Gate(fail=[2])
    worker = TransferWorker.for_kv_caches(
        engine.caches, N, blocks_per_chunk=K, host_budget_bytes=BUDGET, hook=gate
    )
    for job_id in (1, 2, 3):
        worker.submit_store(job(job_id, STORE, [job_id], [2 * job_id, 2 * job_id + 1], K))
    worker.wait([1, 2, 3])
    results = by_id(worker.poll())
    assert results[2].success is False and "injected failure in job 2" in results[2].error
    assert results[1].success and results[3].success
    expected = record(engine, 6) + record(engine, 7)
    assert bytes(worker.slab.slot_bytes(3)) == expected
    worker.shutdown()


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        (job(1, STORE, [SLOTS], [0, 1], K), f"slot {SLOTS} out of range"),
        (job(1, STORE, [0], [0, N], K), f"block id {N} out of range"),
        (job(1, LOAD, [0], [-2, 3], K), "block id -2 out of range"),  # -1 is NO_BLOCK
        (job(1, STORE, [0, 0], [0, 1, 2, 3], K), "slot is written twice"),
        (job(1, LOAD, [0, 1], [5, 6, 7, 5], K), "block id is written twice"),
        (job(1, STORE, [0], [0, 1, 2], 3), "blocks_per_chunk 3"),
    ],
)
def test_bad_jobs_are_failed_results(bad: EngineJob, words: str) -> None:
    worker = make_worker()
    assert worker.slab.num_slots == SLOTS
    (worker.submit_store if bad.kind is STORE else worker.submit_load)(bad)
    worker.submit_store(job(2, STORE, [1], [2, 3], K))
    worker.wait([1, 2])
    results = by_id(worker.poll())
    assert not results[1].success and words in results[1].error
    assert results[2].success
    worker.shutdown()


def test_wrong_direction_is_a_failed_result() -> None:
    worker = make_worker()
    worker.submit_load(job(1, STORE, [0], [0, 1], K))
    worker.wait([1])
    (result,) = worker.poll()
    assert not result.success and "store job, submitted as load" in result.error
    worker.shutdown()


def test_duplicate_in_flight_id_is_a_contract_violation() -> None:
    gate = Gate(hold=[1])
    worker = make_worker(gate)
    worker.submit_store(job(1, STORE, [0], [0, 1], K))
    with pytest.raises(ContractViolation):
        worker.submit_load(job(1, LOAD, [0], [0, 1], K))
    gate.release(1)
    worker.wait([1])
    assert [r.job_id for r in worker.poll()] == [1]
    worker.submit_store(job(1, STORE, [0], [0, 1], K))  # reported: the id may come again
    worker.shutdown()


def test_shutdown_with_jobs_in_flight_loses_nothing() -> None:
    gate = Gate(hold=[1])
    worker = make_worker(gate)
    worker.submit_store(job(1, STORE, [0], [0, 1], K))
    gate.wait_started(1)  # job 1 is running, 2 and 3 are queued behind it
    worker.submit_store(job(2, STORE, [1], [2, 3], K))
    worker.submit_store(job(3, STORE, [2], [4, 5], K))
    closer = threading.Thread(target=worker.shutdown)
    closer.start()
    worker.wait([2, 3])  # cancelled by shutdown while job 1 still runs
    cancelled = by_id(worker.poll())
    assert sorted(cancelled) == [2, 3]
    assert all(not r.success and "shut down" in r.error for r in cancelled.values())
    gate.release(1)
    closer.join(Gate.TIMEOUT)
    assert not closer.is_alive()
    assert [(r.job_id, r.success) for r in worker.poll()] == [(1, True)]
    worker.submit_load(job(4, LOAD, [0], [0, 1], K))
    assert [(r.job_id, r.success) for r in worker.poll()] == [(4, False)]
    worker.shutdown()  # idempotent


def test_shutdown_timeout_abandons_a_stuck_copy_exactly_once() -> None:
    gate = Gate(hold=[1])
    worker = make_worker(gate)
    worker.submit_store(job(1, STORE, [0], [0, 1], K))
    gate.wait_started(1)
    worker.shutdown(timeout=0)
    (result,) = worker.poll()
    assert (result.job_id, result.success) == (1, False) and "abandoned" in result.error
    gate.release(1)  # the copy now completes; its late result is dropped
    worker.shutdown()  # joins the copy thread this time
    assert worker.poll() == []


def test_report_wraps_the_results_with_the_rank() -> None:
    engine = vllm_cpu(N)
    worker = TransferWorker.for_kv_caches(
        engine.caches, N, blocks_per_chunk=K, host_budget_bytes=BUDGET, rank=3
    )
    worker.submit_store(job(7, STORE, [0], [0, 1], K))
    worker.wait([7])
    report = worker.report()
    assert isinstance(report, WorkerReport) and report.rank == 3
    assert [(r.job_id, r.success) for r in report.results] == [(7, True)]
    assert worker.report() == WorkerReport(3, ())
    worker.shutdown()
