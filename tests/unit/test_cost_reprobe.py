"""The cost model looks again (decision 0013): a lane declined under ``load_policy:
cost`` is re-measured by a probe, the first chunk of a hit's part loaded anyway once
the backoff has passed and the hits declined since cover its cost, and loads again once
the probe says it is fast; driven call by call on the scheduler half
(:class:`tests.unit.test_cost.Rig`: DOC's four one-block chunks on disk only, recomputing
DOC takes 16 ms; the clock is the test's)."""

from __future__ import annotations

import pytest
from tests.unit.test_cost import Rig
from tests.unit.test_scheduler import ok

from kvoffload.core.cost import LaneCosts, ProbeState, Verdict, fixed_timing
from kvoffload.core.cost.probing import FIRST_BACKOFF_S, PROBE_SHARE, LaneProbe
from kvoffload.core.failures import error_failure, timeout_failure
from kvoffload.core.jobs import EngineJob, JobResult, WorkerReport
from kvoffload.core.scheduler_types import StepInput

PROBE = 4  # tokens a probe loads: one chunk of one 4-token block


def declined_rig(**config: object) -> Rig:
    """A rig whose disk lane was timed slow (4 chunks: 100 ms against 16 ms) and just
    declined a hit."""
    rig = Rig(**config)
    rig.disk_takes(0.025)
    assert rig.ask("first") == 0
    assert rig.s.cost.verdicts["disk"] is Verdict.RECOMPUTE
    return rig


def earn_credit(rig: Rig) -> int:
    """Hits declined (each asked by a new request) until they cover the next probe's
    cost (``PROBE_SHARE`` of their recompute time); how many."""
    probe: LaneProbe = rig.s.cost.probes["disk"]
    for n in range(10_000):
        if probe.declined_s * PROBE_SHARE >= probe.cost_s:
            return n
        assert rig.ask(f"declined{len(rig.s.request_ids())}") == 0
    raise AssertionError("the credit never covered the probe")


def declined_until_probed(rig: Rig) -> int:
    """Hits (each asked by a new request) declined before one is the probe; how many."""
    for n in range(10_000):
        answer = rig.ask(f"declined{len(rig.s.request_ids())}")
        if answer == PROBE:
            return n
        assert answer == 0
    raise AssertionError("never probed")


def probes(rig: Rig) -> float:
    return rig.s.metrics.value("cost_probes_total", tier="disk")


def land(rig: Rig, seconds_per_chunk: float) -> EngineJob:
    """The one load in flight lands, timed at ``seconds_per_chunk`` per chunk."""
    rig.s.cost.timing = fixed_timing({"disk": LaneCosts(0.0, seconds_per_chunk)})
    (load,) = rig.s.build_plan(StepInput()).loads
    assert isinstance(load, EngineJob)
    rig.s.on_report(ok((load,)))
    return load


def test_a_declined_lane_turned_fast_is_probed_and_loads_again() -> None:
    rig = declined_rig()
    probe = rig.s.cost.probes["disk"]
    assert probe.cost_s == pytest.approx(0.025)  # one chunk's read, as the lane expects
    # 25 ms / 5% = 500 ms: 16 more hits of 32 ms (shared: several requests are tracked)
    assert earn_credit(rig) == 16
    rig.clock.now += FIRST_BACKOFF_S - 0.001
    assert rig.ask("early") == 0  # the credit is there, the backoff not over: declined
    rig.clock.now += 0.001
    assert rig.ask("p") == PROBE  # due: the first chunk is loaded as the probe
    assert probe.state is ProbeState.OFFERED
    assert rig.declined() == 18  # the probed lookup is not counted as declined
    rig.admit("p")
    assert probe.state is ProbeState.IN_FLIGHT and probes(rig) == 1
    assert rig.ask("q") == 0  # one probe in flight per lane
    load = land(rig, 0.001)  # the disk is fast now: 1 ms per chunk
    assert load.tier == "disk" and len(load.keys) == 1
    assert rig.s.cost.lane("disk").samples == 1  # the probe started the window again
    assert probe.state is ProbeState.WAITING
    assert rig.ask("r") == 16  # 4 ms against 16 ms: loads the whole part again
    assert rig.s.cost.verdicts["disk"] is Verdict.LOAD
    assert probe.state is ProbeState.IDLE and probe.backoff_s == FIRST_BACKOFF_S
    assert probes(rig) == 1
    rig.s.check_integrity()


def test_a_lane_that_stays_slow_is_probed_ever_more_rarely() -> None:
    rig = declined_rig()
    earn_credit(rig)
    rig.clock.now += FIRST_BACKOFF_S
    assert rig.ask("p1") == PROBE
    rig.admit("p1")
    rig.clock.now += 0.050  # its request waits 50 ms for it
    land(rig, 0.025)  # still slow: its read took 25 ms
    probe = rig.s.cost.probes["disk"]
    assert probe.state is ProbeState.WAITING and probe.backoff_s == 2 * FIRST_BACKOFF_S
    assert probe.cost_s == pytest.approx(0.050)  # the longer of its read and its wait
    assert rig.s.cost.verdicts["disk"] is Verdict.RECOMPUTE
    assert earn_credit(rig) == 32  # 50 ms / 5% = 1 s: 32 hits of 32 ms
    assert probe.due_at == rig.clock.now + 2 * FIRST_BACKOFF_S  # two backoffs after it
    rig.clock.now = probe.due_at - 0.001
    assert rig.ask("a") == 0
    rig.clock.now = probe.due_at
    assert rig.ask("p2") == PROBE
    rig.admit("p2")
    land(rig, 0.025)
    assert probe.backoff_s == 4 * FIRST_BACKOFF_S and probes(rig) == 2
    assert rig.ask("b") == 0


def test_a_probe_offered_and_not_admitted_lapses_to_another_request() -> None:
    rig = declined_rig()
    earn_credit(rig)
    rig.clock.now += FIRST_BACKOFF_S
    assert rig.ask("p") == PROBE
    assert rig.ask("p") == PROBE  # looked up again: still its probe
    assert rig.ask("o1") == 0  # one probe per lane: the offer holds it
    rig.s.build_plan(StepInput())
    assert rig.ask("o2") == 0  # a promotion would be planned in this plan
    rig.s.build_plan(StepInput())  # not planned by the second plan: lapsed
    assert rig.ask("o3") == PROBE
    rig.admit("o3")
    assert probes(rig) == 1


def timed_out_read(rig: Rig, deadline_s: float) -> None:
    """The one load in flight fails at its ``deadline_s`` deadline, counted for it."""
    (load,) = rig.s.build_plan(StepInput()).loads
    rig.s.cost.timing = lambda job, result: result.seconds  # the deadline, as reported
    timeout = timeout_failure(f"tier read past {deadline_s} s")
    result = JobResult(load.job_id, False, seconds=deadline_s, failed_chunks=((0, timeout),))
    rig.s.on_report(WorkerReport(0, (result,)))


def test_a_lane_declined_for_a_timeout_is_probed_the_same_way() -> None:
    """The lane's first load timed out at its 500 ms deadline: declined. Once the
    backoff has passed and the hits declined cover a probe, the probe lands fast and
    the lane loads again."""
    rig = Rig()
    assert rig.ask("a") == 16  # unmeasured: loaded
    rig.admit("a")
    timed_out_read(rig, 0.5)
    assert rig.ask("b") == 0  # declined: 500 ms against 32 ms (shared with "a")
    assert rig.s.cost.probes["disk"].cost_s == pytest.approx(0.125)  # a chunk's share
    assert earn_credit(rig) == 78  # 125 ms / 5% = 2.5 s: 79 hits of 32 ms, b's too
    rig.clock.now += FIRST_BACKOFF_S
    assert rig.ask("p") == PROBE
    rig.admit("p")
    land(rig, 0.001)
    assert rig.ask("c") == 16


def test_a_probe_that_times_out_needs_the_credit_of_its_deadline() -> None:
    rig = declined_rig()
    earn_credit(rig)
    rig.clock.now += FIRST_BACKOFF_S
    assert rig.ask("p") == PROBE
    rig.admit("p")
    timed_out_read(rig, 0.5)
    probe = rig.s.cost.probes["disk"]
    assert probe.cost_s == 0.5 and probe.due_at == rig.clock.now + 2 * FIRST_BACKOFF_S
    assert rig.s.cost.lane("disk").samples == 1  # the deadline, alone
    rig.clock.now += 2 * FIRST_BACKOFF_S
    assert rig.ask("q") == 0  # the backoff is over; the credit is not
    assert declined_until_probed(rig) == 311  # 500 ms / 5% = 10 s: 313 hits of 32 ms


def test_a_probe_that_fails_teaches_nothing_and_ends() -> None:
    """A probe's read failing for another reason than its deadline says nothing about
    the lane's speed: the window keeps its samples; the probe ends all the same (the
    backoff doubles), and its request recomputes."""
    rig = declined_rig()
    earn_credit(rig)
    rig.clock.now += FIRST_BACKOFF_S
    assert rig.ask("p") == PROBE
    rig.admit("p")
    (load,) = rig.s.build_plan(StepInput()).loads
    error = error_failure("disk read failed")
    rig.s.on_report(WorkerReport(0, (JobResult(load.job_id, False, failed_chunks=((0, error),)),)))
    probe = rig.s.cost.probes["disk"]
    assert probe.state is ProbeState.WAITING and probe.backoff_s == 2 * FIRST_BACKOFF_S
    assert rig.s.cost.lane("disk").samples == 3  # disk_takes' three, untouched
    assert rig.s.stats.load_failures == 1
    rig.s.check_integrity()


def test_a_due_probe_waits_for_a_tier_that_cannot_tell_yet() -> None:
    """A declined tier whose index cannot tell yet is not waited for (its hit would be
    declined), except while its probe is due (its hit would be the probe)."""
    rig = declined_rig()
    earn_credit(rig)
    rig.disk.present_run = lambda keys: None  # type: ignore[method-assign]
    assert rig.ask("a") == 0  # not waited for
    assert rig.declined("unanswered") == 1
    rig.clock.now += FIRST_BACKOFF_S
    assert rig.ask("b") is None  # retry later: the answer may make the probe


def test_a_probe_by_promotion_is_counted_when_planned() -> None:
    """With ``direct_tier_loads`` off the probe's chunk is promoted into host memory
    first, planned in the plan after the lookup."""
    rig = declined_rig(direct_tier_loads=False)
    earn_credit(rig)
    rig.clock.now += FIRST_BACKOFF_S
    assert rig.ask("p") is None  # waits for the promotion of the probe's chunk
    state = rig.s.state_of("p")
    assert state is not None and state.promotion is not None
    assert len(state.promotion.keys) == 1
    (promotion,) = rig.s.build_plan(StepInput()).promotions
    assert probes(rig) == 1
    assert rig.s.cost.probes["disk"].state is ProbeState.IN_FLIGHT
    rig.s.cost.timing = fixed_timing({"disk": LaneCosts(0.0, 0.001)})
    rig.s.on_report(ok((promotion,)))
    assert rig.s.cost.lane("disk").samples == 1
    assert rig.ask("p") is None  # fast: the rest of its chunks are promoted now
    assert rig.s.cost.verdicts["disk"] is Verdict.LOAD
    assert len(state.promotion.keys) == 3  # the probe's chunk is in host memory
