"""Load or recompute (decision 0013): the cost model's parts, then the scheduler half's
offers under ``load_policy: cost``, driven call by call with the lanes' timings and the
prefill speed given (no engine, no real time)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from tests.unit.test_scheduler import BS, NS, Clock, Req, ok

from kvoffload.core.cost import (
    Decline,
    LaneCosts,
    LaneModel,
    PrefillMeter,
    Verdict,
    decide_lane,
    fixed_timing,
)
from kvoffload.core.cost.decision import NEGLIGIBLE_S
from kvoffload.core.directory import Directory
from kvoffload.core.failures import error_failure, timeout_failure
from kvoffload.core.jobs import JobResult, WorkerReport
from kvoffload.core.observe.metrics_view import read_metrics
from kvoffload.core.scheduler import OffloadScheduler
from kvoffload.core.scheduler_types import ScheduledRequest, SchedulerConfig, StepInput
from kvoffload.core.tiering.lower import DirectoryTier

DOC = list(range(16))  # four chunks of one block
RATE = 1000.0  # prefill tokens per second: recomputing DOC takes 16 ms


# ------------------------------------------------------------------ the parts


def test_a_lane_learns_its_latency_and_time_per_chunk() -> None:
    lane = LaneModel("disk")
    assert lane.seconds(4) is None  # unmeasured
    for chunks in (1, 2, 4, 8, 4, 1):
        lane.observe(chunks, chunks * 1000, 0.002 + chunks * 0.01)
    latency, per_chunk = lane.fit() or (0.0, 0.0)
    assert latency == pytest.approx(0.002)
    assert per_chunk == pytest.approx(0.01)
    assert lane.seconds(3) == pytest.approx(0.032)
    assert lane.bytes_per_second() == pytest.approx(1000 / 0.01)


def test_a_lane_forgets_old_timings() -> None:
    lane = LaneModel("redis")
    for _ in range(40):
        lane.observe(2, 0, 2.0)  # slow once
    for _ in range(40):
        lane.observe(2, 0, 0.02)  # the window holds only these now
    assert lane.seconds(2) == pytest.approx(0.02)
    lane.observe(0, 0, 5.0)  # nonsense is ignored
    lane.observe(1, 0, float("nan"))
    assert lane.samples == 32


def test_a_shared_lane_is_learned_as_its_throughput() -> None:
    """Jobs that shared a bandwidth-bound lane took longer; counting the chunks queued
    ahead of each makes the time per chunk the lane's throughput, so the queue the
    decision adds is not counted twice."""
    lane = LaneModel("redis")
    for _ in range(4):  # four 2-chunk jobs planned together on a 10 ms/chunk link
        for ahead in (0, 2, 4, 6):
            lane.observe(2, 2000, (ahead + 2) * 0.01, ahead)
    assert lane.seconds(2) == pytest.approx(0.02)  # alone: 20 ms, not the 50 ms mean
    assert lane.seconds(2 + 6) == pytest.approx(0.08)  # behind 6 queued chunks
    assert lane.bytes_per_second() == pytest.approx(1000 / 0.01)
    lane.observe(2, 0, 0.01, -1)  # nonsense is ignored
    assert lane.samples == 16


def test_prefill_speed_comes_from_step_timings() -> None:
    meter = PrefillMeter(500.0)
    assert meter.tokens_per_s() == 500.0  # the seed
    meter.step(0.0, 64)
    meter.step(0.02, 0)  # the 64 tokens took 20 ms
    assert meter.tokens_per_s() == pytest.approx(3200.0)
    meter.step(100.0, 0)  # an idle gap computed nothing: skipped
    meter.step(200.0, 64)
    meter.step(1000.0, 0)  # longer than any step: skipped
    assert meter.tokens_per_s() == pytest.approx(3200.0)


def test_the_verdict_flips_only_outside_the_hysteresis_band() -> None:
    def decide(previous: Verdict, load_s: float) -> Verdict:
        return decide_lane(
            previous,
            load_s=load_s,
            idle_load_s=load_s,
            recompute_s=1.0,
            hysteresis=0.2,
        ).verdict

    assert decide(Verdict.LOAD, 1.1) is Verdict.LOAD  # slower, inside the band
    assert decide(Verdict.LOAD, 1.3) is Verdict.RECOMPUTE
    assert decide(Verdict.RECOMPUTE, 0.9) is Verdict.RECOMPUTE  # faster, inside the band
    assert decide(Verdict.RECOMPUTE, 0.7) is Verdict.LOAD
    unmeasured = decide_lane(
        Verdict.RECOMPUTE,
        load_s=None,
        idle_load_s=None,
        recompute_s=1e-9,
        hysteresis=0.2,
    )
    assert unmeasured.verdict is Verdict.LOAD  # no evidence: load, as always

    def probe(age: float) -> Verdict:
        return decide_lane(
            Verdict.LOAD,
            load_s=None,
            idle_load_s=None,
            recompute_s=1.0,
            hysteresis=0.2,
            probe_age_s=age,
        ).verdict

    assert probe(0.9) is Verdict.LOAD  # the probe is younger than recomputing: load
    assert probe(1.1) is Verdict.LOAD  # older: recomputed, the verdict kept
    assert (
        decide_lane(
            Verdict.LOAD,
            load_s=None,
            idle_load_s=None,
            recompute_s=1.0,
            hysteresis=0.2,
            probe_age_s=1.1,
        ).decline
        is Decline.UNMEASURED
    )
    negligible = decide_lane(
        Verdict.LOAD,
        load_s=NEGLIGIBLE_S,
        idle_load_s=NEGLIGIBLE_S,
        recompute_s=1e-9,
        hysteresis=0.2,
    )
    assert negligible.verdict is Verdict.LOAD


def test_a_decline_names_the_queue_when_an_idle_lane_would_load() -> None:
    queue = decide_lane(Verdict.LOAD, load_s=3.0, idle_load_s=0.5, recompute_s=1.0, hysteresis=0.2)
    transfer = decide_lane(
        Verdict.LOAD, load_s=3.0, idle_load_s=2.0, recompute_s=1.0, hysteresis=0.2
    )
    assert queue.decline is Decline.QUEUE and transfer.decline is Decline.TRANSFER


# ------------------------------------------------------------ the scheduler half


@dataclass
class ParamReq(Req):
    kv_transfer_params: Any = None


class Rig:
    """A scheduler half under ``load_policy: cost`` with a disk tier holding DOC's four
    chunks (host memory holds none), a fixed prefill seed and no step timed."""

    def __init__(self, policy: str = "cost", **config_fields: Any) -> None:
        self.clock = Clock()
        config = SchedulerConfig(
            block_size=BS,
            load_policy=policy,
            prefill_tokens_per_s=RATE,
            world_size=1,
            **config_fields,
        )
        self.disk = DirectoryTier(Directory(16, tier="disk"))
        self.s = OffloadScheduler(
            config, Directory(16), NS, lower_tiers=[self.disk], clock=self.clock
        )
        self.next_block = 1
        req = Req("seed", DOC)
        assert self.s.lookup(req, 0) == 0
        self.s.on_allocated(req, (self.blocks(4),), 0)
        scheduled = ScheduledRequest("seed", 0, len(DOC), (tuple(range(1, 5)),), True)
        (store,) = self.s.build_plan(StepInput((scheduled,))).stores
        self.s.on_report(ok((store,)))
        self.s.on_finished("seed")
        plan = self.s.build_plan(StepInput())
        self.s.on_report(ok(plan.spills))
        self.s.directory.discard(list(store.keys))  # evicted from host memory
        assert self.disk.held_count() == 4

    def blocks(self, n: int) -> tuple[int, ...]:
        first, self.next_block = self.next_block, self.next_block + n
        return tuple(range(first, first + n))

    def disk_takes(self, seconds_per_chunk: float) -> None:
        """The disk lane's timings: ``seconds_per_chunk`` per chunk, no latency (its
        jobs' results count for as much)."""
        self.s.cost.timing = fixed_timing({"disk": LaneCosts(0.0, seconds_per_chunk)})
        for chunks in (1, 4, 2):
            self.s.cost.lane("disk").observe(chunks, chunks * 64, chunks * seconds_per_chunk)

    def ask(self, request_id: str, params: Any = None) -> int | None:
        return self.s.lookup(ParamReq(request_id, list(DOC) + [99], kv_transfer_params=params), 0)

    def admit(self, request_id: str) -> None:
        """Allocate and plan the load ``request_id`` was offered (left in flight)."""
        state = self.s.state_of(request_id)
        assert state is not None and state.lookup_hit is not None
        self.s.on_allocated(state.request, (self.blocks(5),), state.lookup_hit[1])

    def declined(self, reason: str = "transfer") -> float:
        return self.s.metrics.value("hits_declined_total", tier="disk", reason=reason)


def test_a_tier_slower_than_recomputing_is_declined_at_once() -> None:
    rig = Rig()
    rig.disk_takes(0.025)  # four chunks: 100 ms to load, 16 ms to recompute
    assert rig.ask("a") == 0  # recompute; never retry-later
    assert rig.declined() == 1
    assert rig.s.metrics.value("declined_tokens_total", tier="disk") == 16
    assert rig.s.state_of("a").promotion is None  # type: ignore[union-attr]


def test_a_fast_tier_is_taken_and_an_unmeasured_one_probed_by_its_first_load() -> None:
    rig = Rig()
    assert rig.ask("a") == 16  # no timing yet: loaded, as always; it measures the lane
    rig.admit("a")
    # Now "a" shares the engine: recomputing counts twice (16 ms x 2 = 32 ms).
    rig.clock.now += 0.030  # the probe in flight for 30 ms: less than 32 ms
    assert rig.ask("b") == 16  # concurrent hits of a fresh engine load too
    rig.admit("b")
    rig.clock.now += 0.003  # in flight for 33 ms: already slower than recomputing
    assert rig.ask("c") == 0
    assert rig.declined("unmeasured") == 1
    rig.disk_takes(0.001)  # 4 ms against 32 ms (its queue: 8 chunks, 12 ms in all)
    assert rig.ask("d") == 16
    assert rig.declined() == 0


def test_load_always_keeps_every_hit() -> None:
    rig = Rig(policy="always")
    rig.disk_takes(0.025)
    assert rig.ask("a") == 16
    rig = Rig()
    rig.disk_takes(0.025)
    assert rig.ask("a", {"kvoffload": {"load": "always"}}) == 16  # per request
    assert rig.ask("b") == 0
    assert rig.declined() == 1


def test_a_growing_queue_flips_the_decision_and_a_drained_one_flips_it_back() -> None:
    rig = Rig()
    rig.disk_takes(0.004)  # idle: 16 ms against 16 ms (alone), inside the band: loads
    assert rig.ask("a") == 16
    rig.admit("a")  # shared now: against 32 ms; 4 chunks queued: 32 ms, inside the band
    assert rig.ask("b") == 16
    rig.admit("b")  # 8 queued: 48 ms > 32 ms * 1.2
    assert rig.s.cost.queued_chunks("disk") == 8
    assert rig.ask("c") == 0
    assert rig.declined("queue") == 1 and rig.declined("transfer") == 0
    loads = rig.s.build_plan(StepInput()).loads
    rig.s.on_report(ok(loads[:1]))  # 4 queued: 32 ms, inside the band: still recomputes
    assert rig.ask("d") == 0
    rig.s.on_report(ok(loads[1:]))  # drained: 16 ms < 32 ms * 0.8
    assert rig.ask("e") == 16
    reading = read_metrics(rig.s, 64)
    assert reading.value("cost_lane_loads", tier="disk") == 1
    assert reading.value("cost_lane_queued_chunks", tier="disk") == 0
    assert reading.value("cost_prefill_tokens_per_second") == RATE
    rig.s.check_integrity()


def test_a_slow_answer_or_a_slow_tier_is_not_waited_for() -> None:
    """A tier that cannot tell yet is waited for (retry later) for two engine steps,
    then as long as recomputing what it may hold would take; a tier whose idle lane is
    slower than recomputing is not waited for at all (its hit would be declined):
    lookup answers at once, counted ``unanswered``."""
    rig = Rig()
    rig.disk.present_run = lambda keys: None  # type: ignore[method-assign]
    assert rig.ask("a") is None  # retry later: the disk may hold the prefix
    rig.clock.now += 0.030  # longer than the 16 ms recomputing takes, but one step
    rig.s.deferral.tick(True)
    assert rig.ask("a") is None
    rig = Rig()
    rig.disk.present_run = lambda keys: None  # type: ignore[method-assign]
    assert rig.ask("a") is None
    rig.s.deferral.tick(True)
    rig.s.deferral.tick(True)  # two steps: the grace is over
    rig.clock.now += 0.015  # waited 15 ms: recomputing its 16 tokens takes 16 ms
    assert rig.ask("a") is None
    assert rig.declined("unanswered") == 0
    rig.clock.now += 0.002
    assert rig.ask("a") == 0  # waited longer than recomputing takes: not any more
    assert rig.declined("unanswered") == 1
    rig = Rig()
    rig.disk_takes(0.025)  # idle: 100 ms against 16 ms
    rig.disk.present_run = lambda keys: None  # type: ignore[method-assign]
    assert rig.ask("b") == 0  # not waited for
    assert rig.declined("unanswered") == 1
    assert rig.ask("c", {"kvoffload": {"load": "always"}}) is None  # always waits


def test_a_read_that_timed_out_teaches_its_lane_and_other_failures_do_not() -> None:
    """A tier read reported failed at its deadline took at least that long (the worker
    reports the deadline as its seconds): the lane learns it is slow. Any other
    failure teaches nothing; while the lane is unmeasured, its probe's age says so."""
    rig = Rig()
    assert rig.ask("a") == 16
    rig.admit("a")  # the probe: in flight
    assert not rig.s.cost.slower("disk", 4, 0.016)
    rig.clock.now += 0.020
    assert rig.s.cost.slower("disk", 4, 0.016)  # in flight longer than recomputing
    (load,) = rig.s.build_plan(StepInput()).loads
    timeout = timeout_failure("tier read past 5 s")
    result = JobResult(load.job_id, False, seconds=5.0, failed_chunks=((0, timeout),))
    rig.s.cost.timing = lambda job, result: result.seconds  # the measurement itself
    other = JobResult(load.job_id, False, seconds=5.0, failed_chunks=((0, error_failure("x")),))
    rig.s.cost.observe(load, other)
    assert rig.s.cost.lane("disk").samples == 0
    rig.s.on_report(WorkerReport(0, (result,)))
    assert rig.s.cost.lane("disk").samples == 1
    assert rig.s.cost.slower("disk", 4, 0.016)
    assert rig.ask("b") == 0  # declined: 5 s against 16 ms
