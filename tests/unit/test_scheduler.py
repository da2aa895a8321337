"""Unit tests of the scheduler half, driven call by call (no engine)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvoffload.core.directory import Directory
from kvoffload.core.jobs import EngineJob, JobKind, JobResult, StepPlan, TransferJob, WorkerReport
from kvoffload.core.keys import ChunkKey, Namespace, block_hashes
from kvoffload.core.observe.anomalies import Anomaly
from kvoffload.core.observe.events import EventKind
from kvoffload.core.scheduler import OffloadScheduler
from kvoffload.core.scheduler.request_state import Phase
from kvoffload.core.scheduler_types import (
    RETRY_LATER,
    Deferral,
    ScheduledRequest,
    SchedulerConfig,
    StepInput,
)

BS = 4  # tokens per block
NS = Namespace("m", "layout", "f32")
KEY, KEY2 = ChunkKey(b"\x01" * 16), ChunkKey(b"\x02" * 16)


@dataclass
class Req:
    request_id: str
    tokens: list[int]
    num_computed_tokens: int = 0
    salt: str | None = None
    _hashes: list[bytes] = field(default_factory=list)

    @property
    def block_hashes(self) -> list[bytes]:
        if len(self._hashes) != len(self.tokens) // BS:
            self._hashes = block_hashes(self.tokens, BS, self.salt)
        return self._hashes

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(
    slots: int = 16, k: int = 1, world_size: int = 1, **kw: object
) -> tuple[OffloadScheduler, Clock]:
    clock = Clock()
    config = SchedulerConfig(block_size=BS, blocks_per_chunk=k, world_size=world_size, **kw)  # type: ignore[arg-type]
    return OffloadScheduler(config, Directory(slots), NS, clock=clock), clock


def ok(jobs: list[TransferJob] | tuple[TransferJob, ...], rank: int = 0) -> WorkerReport:
    return WorkerReport(rank, tuple(JobResult(j.job_id, True) for j in jobs))


def failed(jobs: tuple[TransferJob, ...]) -> WorkerReport:
    return WorkerReport(0, tuple(JobResult(j.job_id, False) for j in jobs))


def alloc(s: OffloadScheduler, request_id: str, blocks: list[int], external: int) -> None:
    """``on_allocated`` for a request that was looked up (its state knows it)."""
    state = s.state_of(request_id)
    assert state is not None
    s.on_allocated(state.request, (blocks,), external)


def run_prefill(s: OffloadScheduler, req: Req, blocks: list[int]) -> StepPlan:
    """Admit ``req`` with no hit and compute its whole prompt in one step."""
    assert s.lookup(req, 0) == 0
    s.on_allocated(req, (blocks,), 0)
    req.num_computed_tokens = req.num_tokens
    return s.build_plan(
        StepInput((ScheduledRequest(req.request_id, 0, req.num_tokens, (tuple(blocks),), True),))
    )


def store_prompt(s: OffloadScheduler, req: Req, blocks: list[int]) -> None:
    plan = run_prefill(s, req, blocks)
    s.on_report(ok(plan.stores))
    s.on_finished(req.request_id)
    s.build_plan(StepInput())


def test_pending_transfer_defers_prefix_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    """A request with a job in flight gets RETRY_LATER, its stale block ids are
    cleared, and the directory is not consulted."""
    s, _ = make()
    req = Req("a", list(range(12)))
    plan = run_prefill(s, req, [1, 2, 3])
    assert len(plan.stores) == 1
    state = s.state_of("a")
    assert state is not None and state.blocks[0] == [1, 2, 3]

    def no_lookup(*args: object) -> None:
        raise AssertionError("the directory was consulted")

    monkeypatch.setattr(s.directory, "readable_prefix", no_lookup)
    monkeypatch.setattr(s.directory, "lookup", no_lookup)
    assert s.lookup(req, 0) is RETRY_LATER
    assert state.blocks[0] == []
    assert s.metrics.breakdown("deferrals_total", "reason") == {"transfer_in_flight": 1}
    s.check_integrity()


def test_lookup_hits_misses_and_the_one_chunk_rule() -> None:
    s, _ = make(k=2)  # chunk = 8 tokens
    store_prompt(s, Req("a", list(range(16))), [1, 2, 3, 4])
    assert s.lookup(Req("b", list(range(16))), 0) == 16
    assert s.lookup(Req("c", list(range(16))), 4) == 12  # starts inside chunk 0
    assert s.lookup(Req("d", list(range(16))), 8) == 8
    assert s.lookup(Req("e", list(range(16))), 12) == 0  # 4 tokens < one chunk
    assert s.lookup(Req("f", [9, *range(1, 16)]), 0) == 0
    s.check_integrity()


def test_a_hit_after_the_engine_s_own_chunks_needs_no_host_copy_of_them() -> None:
    """The engine's prefix cache keeps a shared prefix (a system prompt) that is never
    loaded, so host eviction takes its chunks first; the chunks after it still hit.
    Found by the e2e tiers benchmark: the host prefix was counted from chunk 0, so a
    request whose first chunk had left host memory never got a hit."""
    s, _ = make(k=2)  # chunk = 8 tokens
    plan = run_prefill(s, Req("a", list(range(24))), [1, 2, 3, 4, 5, 6])
    s.on_report(ok(plan.stores))
    s.on_finished("a")
    s.build_plan(StepInput())
    (store,) = plan.stores
    s.directory.discard([store.keys[0]])  # chunk 0 left host memory
    assert s.lookup(Req("b", [*range(24), 7]), 0) == 0  # the engine lacks it too: no hit
    assert s.lookup(Req("c", [*range(24), 7]), 8) == 16  # it has it: chunks 1-2 hit
    assert s.lookup(Req("d", [*range(24), 7]), 4) == 0  # chunk 0 would be read: no hit
    s.check_integrity()


def test_a_hit_emits_one_load_job_with_a_partial_first_chunk() -> None:
    s, _ = make(k=2)
    store_prompt(s, Req("a", list(range(24))), [1, 2, 3, 4, 5, 6])
    b = Req("b", list(range(24)) + [7, 7])
    assert s.lookup(b, 4) == 20
    alloc(s, "b", [10, 11, 12, 13, 14, 15, 16], 20)
    plan = s.build_plan(StepInput())
    (load,) = plan.loads
    assert load.kind is JobKind.LOAD and load.request_id == "b"
    assert load.skip_blocks == 1 and load.block_ids == (11, 12, 13, 14, 15)
    assert len(load.keys) == 3 and s.directory.pinned_count == 3
    assert s.state_of("b").phase is Phase.LOADING  # type: ignore[union-attr]
    s.check_integrity()
    s.on_report(ok(plan.loads))
    assert s.directory.pinned_count == 0
    assert s.state_of("b").phase is Phase.RUNNING  # type: ignore[union-attr]
    s.check_integrity()


def test_stores_cover_newly_full_chunks_once_and_the_tail_at_finish() -> None:
    s, _ = make()
    req = Req("a", list(range(10)))
    assert s.lookup(req, 0) == 0
    alloc(s, "a", [1, 2, 3], 0)
    plan = s.build_plan(StepInput((ScheduledRequest("a", 0, 6, ((1, 2, 3),), True),)))
    assert [len(j.keys) for j in plan.stores] == [1] and plan.stores[0].block_ids == (1,)
    plan2 = s.build_plan(StepInput((ScheduledRequest("a", 6, 4, ((),), False),)))
    assert [j.block_ids for j in plan2.stores] == [(2,)]  # block 3 holds 2 tokens
    req.tokens += [5, 5]
    req.num_computed_tokens = 11  # the last sampled token has no KV yet
    s.on_finished("a")
    assert s.build_plan(StepInput()).stores == ()
    req.num_computed_tokens = 12
    s.on_report(ok(plan.stores + plan2.stores))
    assert s.state_of("a") is None  # finished and drained
    assert s.metrics.value("transferred_chunks_total", direction="store", tier="host") == 2
    s.check_integrity()


def test_final_store_of_a_finished_request_is_flushed_when_its_block_is_reused() -> None:
    s, _ = make()
    req = Req("a", list(range(7)))
    s.lookup(req, 0)
    alloc(s, "a", [1, 2], 0)
    s.build_plan(StepInput((ScheduledRequest("a", 0, 7, ((1, 2),), True),)))
    # Asynchronous scheduling: the step computing position 7 is planned before the
    # token is appended, so block 2's hash is unknown and its store cannot be planned.
    s.build_plan(StepInput((ScheduledRequest("a", 7, 1, ((),), False),)))
    req.tokens.append(7)
    req.num_computed_tokens = 8
    s.on_finished("a")  # blocks 1-2 are freed; block 2's chunk is stored by the next plan
    b = Req("b", [50 + i for i in range(8)])
    s.lookup(b, 0)
    alloc(s, "b", [2, 7], 0)
    plan = s.build_plan(StepInput((ScheduledRequest("b", 0, 8, ((2, 7),), True),)))
    final = [j for j in plan.stores if j.request_id == "a"]
    assert [j.block_ids for j in final] == [(2,)]
    assert plan.flush == {final[0].job_id}  # before b's forward overwrites block 2
    s.check_integrity()


def test_prefix_hits_on_a_fenced_block_do_not_flush() -> None:
    s, _ = make()
    a = Req("a", list(range(8)))
    plan = run_prefill(s, a, [1, 2])
    b = Req("b", list(range(8)) + [9, 9, 9, 9])
    s.lookup(b, 4)  # the engine's own prefix cache holds block 1
    alloc(s, "b", [1, 5, 6], 0)
    plan2 = s.build_plan(StepInput((ScheduledRequest("b", 4, 8, ((1, 5, 6),), True),)))
    assert plan2.flush == frozenset()
    s.on_report(ok(plan.stores + plan2.stores))
    s.check_integrity()


def test_preemption_flushes_defers_and_then_loads() -> None:
    s, _ = make()
    req = Req("a", list(range(12)))
    plan = run_prefill(s, req, [1, 2, 3])
    plan2 = s.build_plan(StepInput(preempted=("a",)))
    assert plan2.flush == {plan.stores[0].job_id}
    assert s.state_of("a").phase is Phase.PREEMPTED_DRAINING  # type: ignore[union-attr]
    assert s.lookup(req, 0) is RETRY_LATER
    assert s.lookup(req, 0) is RETRY_LATER
    s.on_report(ok(plan.stores))
    assert s.state_of("a").phase is Phase.WAITING  # type: ignore[union-attr]
    assert s.lookup(req, 0) == 12
    alloc(s, "a", [7, 8, 9], 12)
    assert [j.kind for j in s.build_plan(StepInput()).loads] == [JobKind.LOAD]
    s.check_integrity()


@pytest.mark.parametrize("bound", ["steps", "seconds"])
def test_deferral_is_bounded_and_then_recomputes_without_a_load(bound: str) -> None:
    s, clock = make(max_deferral_steps=3, max_deferral_seconds=10.0)
    req = Req("a", list(range(12)))
    plan = run_prefill(s, req, [1, 2, 3])
    s.build_plan(StepInput(preempted=("a",)))
    assert s.lookup(req, 0) is RETRY_LATER
    if bound == "steps":
        for _ in range(5):  # idle steps do not count
            s.build_plan(StepInput())
        assert s.lookup(req, 0) is RETRY_LATER
        busy = StepInput((ScheduledRequest("b", 0, 4, ((9,),), True),))  # another request ran
        for _ in range(3):
            s.build_plan(busy)
    else:
        clock.now += 10.0
    assert s.lookup(req, 0) == 0  # admitted: recompute, no load on top of the stores
    assert s.metrics.value("deferral_timeouts_total") == 1
    alloc(s, "a", [4, 5, 6], 0)
    plan2 = s.build_plan(StepInput((ScheduledRequest("a", 0, 12, ((4, 5, 6),), True),)))
    assert plan2.loads == ()
    assert s.state_of("a").phase is Phase.RUNNING  # type: ignore[union-attr]
    s.on_report(ok(plan.stores + plan2.stores))
    s.check_integrity()


def test_no_convoy_a_second_request_loads_chunks_another_is_loading() -> None:
    s, _ = make()
    store_prompt(s, Req("a", list(range(12))), [1, 2, 3])
    b, c = Req("b", list(range(12))), Req("c", list(range(12)))
    assert s.lookup(b, 0) == 12
    alloc(s, "b", [4, 5, 6], 12)
    assert s.lookup(c, 0) == 12  # not deferred behind b's load
    alloc(s, "c", [7, 8, 9], 12)
    plan = s.build_plan(StepInput())
    assert [j.request_id for j in plan.loads] == ["b", "c"]
    assert plan.loads[0].slots == plan.loads[1].slots
    assert s.directory.pinned_count == 6
    s.on_report(ok(plan.loads))
    assert s.directory.pinned_count == 0
    s.check_integrity()


def test_a_failed_load_unpins_and_lets_the_request_run() -> None:
    s, _ = make()
    store_prompt(s, Req("a", list(range(8))), [1, 2])
    s.lookup(Req("b", list(range(8))), 0)
    alloc(s, "b", [3, 4], 8)
    plan = s.build_plan(StepInput())
    (done,) = s.on_report(failed(plan.loads))
    assert not done.success and done.job == plan.loads[0] and plan.loads[0].block_ids == (3, 4)
    assert s.stats.load_failures == 1 and s.directory.pinned_count == 0
    assert s.state_of("b").phase is Phase.RUNNING  # type: ignore[union-attr]
    # The chunks may be torn: discarded for everyone, and b recomputes from now on.
    assert s.lookup(Req("c", list(range(8))), 0) == 0
    assert s.lookup(Req("b", list(range(8))), 0) == 0
    store_prompt(s, Req("d", list(range(8))), [5, 6])
    assert s.lookup(Req("b", list(range(8))), 0) == 0  # even once stored again
    assert s.lookup(Req("e", list(range(8))), 0) == 8
    s.check_integrity()


def test_a_failed_store_frees_its_slots() -> None:
    s, _ = make()
    plan = run_prefill(s, Req("a", list(range(8))), [1, 2])
    s.on_report(failed(plan.stores))
    assert s.stats.store_failures == 1
    assert s.directory.used_slots == 0
    assert s.lookup(Req("b", list(range(8))), 0) == 0
    s.check_integrity()


def test_abort_in_every_phase() -> None:
    s, _ = make()
    store_prompt(s, Req("src", list(range(8))), [1, 2])
    # WAITING, never scheduled
    s.lookup(Req("w", [1, 2, 3]), 0)
    s.on_aborted("w")
    assert s.state_of("w") is None
    # LOADING: kept until the load is reported
    s.lookup(Req("l", list(range(8))), 0)
    alloc(s, "l", [5, 6], 8)
    load_plan = s.build_plan(StepInput())
    s.on_aborted("l")
    assert s.state_of("l").phase is Phase.FINISHED_DRAINING  # type: ignore[union-attr]
    # RUNNING with a store in flight
    run_plan = run_prefill(s, Req("r", [40 + i for i in range(8)]), [7, 8])
    s.on_aborted("r")
    assert s.state_of("r").phase is Phase.FINISHING  # type: ignore[union-attr]
    # PREEMPTED_DRAINING
    p_plan = run_prefill(s, Req("p", [60 + i for i in range(8)]), [9, 10])
    s.build_plan(StepInput(preempted=("p",)))
    s.on_aborted("p")
    s.on_aborted("p")  # twice: no-op
    s.on_aborted("r")  # twice: no-op
    # its final store was planned with p's prefill: r's store is still in flight
    assert s.state_of("r").phase is Phase.FINISHED_DRAINING  # type: ignore[union-attr]
    s.build_plan(StepInput())
    s.check_integrity()
    s.on_report(ok(load_plan.loads + run_plan.stores + p_plan.stores))
    assert s.request_ids() == []
    assert s.directory.pinned_count == 0 and s.jobs_in_flight() == []
    s.check_integrity()


def test_a_request_finishing_while_running_waits_for_its_final_store_plan() -> None:
    """FINISHING: finished while running, its final store not yet planned. Nothing
    but the next plan moves it on (here to DONE: its stores were all reported)."""
    s, _ = make()
    req = Req("a", list(range(8)))
    plan = run_prefill(s, req, [1, 2])
    s.on_finished("a")
    state = s.state_of("a")
    assert state is not None and state.phase is Phase.FINISHING
    assert s.has_pending_work()
    s.on_report(ok(plan.stores))  # its jobs drained: still FINISHING
    assert state.phase is Phase.FINISHING and s.state_of("a") is state
    s.check_integrity()
    assert s.lookup(Req("a", list(range(8))), 0) == 0  # a reused id: not offloaded
    assert s.anomalies.counts[Anomaly.REUSED_REQUEST_ID] == 1
    s.on_allocated(Req("a", list(range(8))), ([3, 4],), 0)  # ignored
    s.on_preempted("a")  # ignored
    assert state.phase is Phase.FINISHING
    s.build_plan(StepInput())
    assert state.phase is Phase.DONE and s.state_of("a") is None
    assert not s.has_pending_work()
    s.check_integrity()


def test_a_deferral_keeps_its_start_across_reasons() -> None:
    s, clock = make()
    req = Req("a", list(range(12)))
    run_prefill(s, req, [1, 2, 3])
    clock.now = 5.0
    assert s.lookup(req, 0) is RETRY_LATER
    state = s.state_of("a")
    assert state is not None and state.deferred is not None
    first = state.deferred
    assert (first.since_s, first.reason) == (5.0, Deferral.TRANSFER_IN_FLIGHT)
    clock.now = 6.0
    assert s.lookup(req, 0) is RETRY_LATER
    assert state.deferred == first  # a frozen value: the same start, the same reason


def test_reset_with_jobs_in_flight() -> None:
    s, _ = make()
    store_prompt(s, Req("a", list(range(8))), [1, 2])
    s.lookup(Req("b", list(range(8))), 0)
    alloc(s, "b", [3, 4], 8)
    load_plan = s.build_plan(StepInput())
    store_plan = run_prefill(s, Req("c", [30 + i for i in range(8)]), [5, 6])
    s.take_events()
    s.reset()
    assert [e.kind for e in s.take_events()] == [EventKind.REMOVED]
    assert s.lookup(Req("d", list(range(8))), 0) == 0
    s.on_report(ok(load_plan.loads + store_plan.stores))
    # The pre-reset store completed, but what it stored is not readable.
    assert s.lookup(Req("e", [30 + i for i in range(8)]), 0) == 0
    assert s.take_events() == []
    assert s.directory.pinned_count == 0 and s.directory.used_slots == 0
    s.check_integrity()


def test_world_size_two_completes_once_when_both_workers_reported() -> None:
    s, _ = make(world_size=2)
    plan = run_prefill(s, Req("a", list(range(8))), [1, 2])
    (job,) = plan.stores
    assert s.on_report(ok([job], rank=0)) == []
    assert s.on_report(ok([job], rank=0)) == []  # repeated report: ignored
    assert s.directory.lookup(job.keys).readable_prefix == 0
    (done,) = s.on_report(ok([job], rank=1))
    assert done.success and s.directory.lookup(job.keys).readable_prefix == 2
    assert s.on_report(ok([job], rank=1)) == []  # already complete
    assert s.stats.stale_completions == 1
    plan2 = run_prefill(s, Req("b", [9] * 8), [3, 4])
    s.on_report(ok(plan2.stores, rank=0))
    s.on_report(WorkerReport(1, (JobResult(plan2.stores[0].job_id, False),)))
    assert s.stats.store_failures == 1 and s.directory.used_slots == 2
    s.check_integrity()


def test_no_room_is_retried_in_a_later_step() -> None:
    s, _ = make(slots=2)
    hold = run_prefill(s, Req("a", list(range(8))), [1, 2])  # both slots STORING
    req = Req("b", [20 + i for i in range(8)])
    plan = run_prefill(s, req, [3, 4])
    assert plan.stores == () and s.directory.metrics.value("no_room_total") == 1
    s.on_report(ok(hold.stores))
    plan2 = s.build_plan(StepInput((ScheduledRequest("b", 8, 1, ((),), False),)))
    assert [len(j.keys) for j in plan2.stores] == [2]  # evicts a's READY chunks now
    s.check_integrity()


def test_an_allocation_the_lookup_did_not_offer_is_an_anomaly_not_a_crash() -> None:
    """The engine has the last word: surprising allocations are counted and served
    safely (nothing loaded, or the blocks reported invalid), never raised."""
    s, _ = make()
    nobody = Req("nobody", list(range(8)))
    s.on_allocated(nobody, ([1, 2],), 4)  # never looked up: admitted, nothing loaded
    state = s.state_of("nobody")
    assert state is not None and state.phase is Phase.RUNNING and state.blocks[0] == [1, 2]
    a = Req("a", list(range(8)))
    s.lookup(a, 0)
    s.on_allocated(a, ([3, 4],), 8)  # lookup offered 0
    assert s.build_plan(StepInput()).loads == ()
    assert s.anomalies.counts == {Anomaly.EXTERNAL_TOKENS: 2}
    s.check_integrity()


def test_a_load_of_other_than_the_offered_tokens_reports_its_blocks_invalid() -> None:
    s, _ = make()
    store_prompt(s, Req("a", list(range(12))), [1, 2, 3])
    b = Req("b", list(range(12)))
    assert s.lookup(b, 0) == 12
    s.on_allocated(b, ([4, 5, 6],), 8)  # the engine takes less than offered
    (load,) = s.build_plan(StepInput()).loads
    assert load.keys == () and load.invalid_blocks == (4, 5)
    assert s.directory.pinned_count == 0
    s.on_report(ok([load]))
    state = s.state_of("b")
    assert state is not None and state.phase is Phase.RUNNING and state.load_failed
    assert s.anomalies.counts == {Anomaly.EXTERNAL_TOKENS: 1}
    s.check_integrity()


def test_a_store_never_reads_the_null_block_or_a_block_twice() -> None:
    s, _ = make(null_block=0)
    req = Req("a", list(range(16)))
    assert s.lookup(req, 0) == 0
    s.on_allocated(req, ([5, 0, 6, 6],), 0)
    req.num_computed_tokens = 16
    plan = s.build_plan(StepInput((ScheduledRequest("a", 0, 16, ((5, 0, 6, 6),), True),)))
    (store,) = plan.stores
    assert store.block_ids == (5,)  # chunk 1 (null block) and after: not stored
    assert s.anomalies.counts == {Anomaly.NULL_BLOCK: 1}
    s.on_report(ok(plan.stores))
    s.check_integrity()


def test_a_store_naming_a_block_twice_completes_without_raising() -> None:
    """A job naming one block twice (vLLM's null block, as a sliding window leaves
    it) used to raise KeyError inside vLLM's update_from_output."""
    from kvoffload.core.scheduler.job_tracker import JobTracker

    tracker = JobTracker(1)
    job = EngineJob(1, JobKind.STORE, "a", (KEY, KEY2), (0, 1), (7, 7), 1)
    tracker.add(job)
    assert tracker.fence_count() == 1
    done = tracker.record(0, JobResult(1, True))
    assert done is not None and tracker.fence_count() == 0


def test_a_hit_the_engine_did_not_allocate_while_idle_is_deferred_then_recomputed() -> None:
    """An engine that could not allocate the hit it was offered and ran nothing since
    (only waiting requests hold blocks) would stall on the same offer for good: the
    next lookup answers retry-later (no_room), so the engine serves the requests
    behind this one; past the deferral bound the request recomputes. While requests
    run, the same offer stands (the engine's own back pressure)."""
    s, clock = make(max_deferral_steps=50, max_deferral_seconds=1.0)
    store_prompt(s, Req("a", list(range(12))), [1, 2, 3])
    b = Req("b", list(range(12)) + [99])
    assert s.lookup(b, 0) == 12  # offered; the engine could not allocate it
    busy = StepInput((ScheduledRequest("x", 0, 4, ((9,),), True),))
    s.build_plan(busy)  # other requests ran: the offer stands
    assert s.lookup(b, 0) == 12
    s.build_plan(StepInput())
    assert s.lookup(b, 0) == 12  # one idle step is a batch queue's rhythm
    s.build_plan(StepInput())
    assert s.lookup(b, 0) is RETRY_LATER  # stalled: the requests behind go first
    assert s.metrics.breakdown("deferrals_total", "reason")["no_room"] == 1
    s.build_plan(StepInput())
    clock.now += 1.0
    assert s.lookup(b, 0) == 12  # offered again (nothing pending from last answer)
    s.build_plan(StepInput())
    s.build_plan(StepInput())
    assert s.lookup(b, 0) == 0  # still stalled past the bound: recompute
    assert s.metrics.value("deferral_timeouts_total") == 1
    alloc(s, "b", [4, 5, 6, 7], 0)
    assert s.state_of("b").phase is Phase.RUNNING  # type: ignore[union-attr]
    s.check_integrity()
