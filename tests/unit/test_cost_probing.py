"""A declined lane's probe (decision 0013, "The cost model looks again"): every move of
:class:`LaneProbe`'s table, the backoff and its bound, and the lane's window started
again by a probe's timing. Pure: time is given to every call."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest

from kvoffload.core.cost import LaneModel, LaneProbe, ProbeState
from kvoffload.core.cost.probing import (
    FIRST_BACKOFF_S,
    MAX_BACKOFF_S,
    PROBE_SHARE,
    TRANSITIONS,
)
from kvoffload.core.errors import IllegalTransition

S = ProbeState
COST = 0.01  # what a probe is expected to cost its request
CREDIT = COST / PROBE_SHARE  # recompute time a probe's credit needs


def waiting(now: float = 0.0) -> LaneProbe:
    """Declined at ``now``, with the credit of one probe."""
    probe = LaneProbe()
    probe.declined(now, CREDIT, COST)
    return probe


def offered(request_id: str = "a", plan: int = 5) -> LaneProbe:
    probe = waiting()
    assert probe.offer(FIRST_BACKOFF_S, request_id, plan)
    return probe


def in_flight(job_id: int = 7, now: float = FIRST_BACKOFF_S) -> LaneProbe:
    probe = offered()
    assert probe.planned(job_id, "a", now)
    return probe


def test_a_declined_lane_waits_for_its_first_probe() -> None:
    probe = LaneProbe()
    assert probe.state is S.IDLE and not probe.due(1e9)
    probe.declined(10.0, CREDIT / 2, COST)  # IDLE -> WAITING
    assert probe.state is S.WAITING and probe.due_at == 10.0 + FIRST_BACKOFF_S
    assert probe.cost_s == COST and probe.declined_s == CREDIT / 2
    assert not probe.due(11.0)  # the backoff is over, the credit is not enough
    probe.declined(10.5, CREDIT / 2, 99.0)  # declined again: credit; cost and due kept
    assert probe.due_at == 10.0 + FIRST_BACKOFF_S and probe.cost_s == COST
    assert not probe.due(10.9)  # the credit is enough, the backoff not over
    assert probe.due(11.0)


def test_a_due_probe_is_offered_once_to_one_request() -> None:
    probe = waiting()
    assert not probe.offer(0.5, "a", 1)  # not due yet
    assert probe.state is S.WAITING
    assert probe.offer(1.0, "a", 1)  # WAITING -> OFFERED
    assert probe.state is S.OFFERED and probe.request_id == "a"
    assert probe.offer(1.1, "a", 1)  # the same request looked up again
    assert not probe.offer(1.1, "b", 1)  # one probe per lane at a time
    assert not probe.due(1.1)


def test_the_offered_request_s_job_is_the_probe_and_spends_the_credit() -> None:
    probe = offered("a")
    assert not probe.planned(3, "b", 1.0)  # another request's job
    assert probe.state is S.OFFERED
    assert probe.planned(4, "a", 1.0)  # OFFERED -> IN_FLIGHT
    assert probe.state is S.IN_FLIGHT and probe.job_id == 4
    assert probe.declined_s == 0.0
    probe.declined(1.1, CREDIT, COST)  # declined while it flies: the next one's credit
    assert not probe.planned(5, "a", 1.1)  # already in flight
    assert not probe.offer(1e9, "c", 9)


def test_an_offer_not_planned_by_the_second_plan_lapses() -> None:
    probe = offered(plan=5)
    probe.on_plan(6, 2.0, set())  # the plan right after the offer (a promotion's)
    assert probe.state is S.OFFERED
    probe.on_plan(7, 2.0, set())  # OFFERED -> WAITING: due again at once
    assert probe.state is S.WAITING and probe.request_id is None
    assert probe.offer(2.0, "b", 7)
    assert probe.backoff_s == FIRST_BACKOFF_S  # nothing was probed


def test_a_probe_s_result_ends_it_and_the_backoff_doubles() -> None:
    probe = in_flight(job_id=7, now=1.0)
    assert not probe.result(8, 3.0, 0.01)  # another job's
    assert probe.state is S.IN_FLIGHT
    assert probe.result(7, 1.5, 0.2)  # IN_FLIGHT -> WAITING
    assert probe.state is S.WAITING and probe.job_id is None
    assert probe.backoff_s == 2 * FIRST_BACKOFF_S
    assert probe.due_at == 1.5 + 2 * FIRST_BACKOFF_S
    assert probe.cost_s == 0.5  # its request waited 0.5 s, longer than its 0.2 s read
    assert not probe.result(7, 1.6, 0.01)  # another worker's result of it: not the first


def test_a_probe_whose_job_left_without_a_result_ends() -> None:
    probe = in_flight(job_id=7, now=1.0)
    probe.on_plan(100, 4.0, {7})  # still in flight
    assert probe.state is S.IN_FLIGHT
    probe.on_plan(101, 4.0, {8})  # IN_FLIGHT -> WAITING
    assert probe.state is S.WAITING and probe.due_at == 4.0 + 2 * FIRST_BACKOFF_S
    assert probe.cost_s == 3.0


@pytest.mark.parametrize("make", [waiting, offered, in_flight], ids=lambda f: f.__name__)
def test_a_lane_that_loads_again_needs_no_probe(make: Callable[[], LaneProbe]) -> None:
    probe = make()
    probe.backoff_s = 32.0
    probe.loads()  # WAITING / OFFERED / IN_FLIGHT -> IDLE
    assert probe.state is S.IDLE
    assert probe.backoff_s == FIRST_BACKOFF_S and probe.due_at == math.inf
    assert probe.declined_s == probe.cost_s == 0.0
    assert probe.request_id is None and probe.job_id is None
    probe.loads()  # IDLE stays IDLE
    assert probe.state is S.IDLE


def test_every_move_of_the_table_is_made_and_no_other() -> None:
    made = {
        (S.IDLE, S.WAITING),
        (S.WAITING, S.OFFERED),
        (S.OFFERED, S.IN_FLIGHT),
        (S.OFFERED, S.WAITING),
        (S.IN_FLIGHT, S.WAITING),
        (S.WAITING, S.IDLE),
        (S.OFFERED, S.IDLE),
        (S.IN_FLIGHT, S.IDLE),
    }  # each by a test above
    assert set(TRANSITIONS) == made
    probe = LaneProbe()
    with pytest.raises(IllegalTransition):
        probe._move(S.IN_FLIGHT)  # IDLE -> IN_FLIGHT: never
    assert probe.state is S.IDLE


def run_slow_lane(hits_per_s: float, recompute_s: float, probe_s: float) -> list[float]:
    """An hour of a lane that stays slow: a declined hit every ``1 / hits_per_s``
    seconds, each ``recompute_s`` to recompute, each probe ``probe_s`` to land. The
    times probes were planned."""
    probe, at, step = LaneProbe(), [], 1.0 / hits_per_s
    for i in range(round(3600 * hits_per_s)):
        now = i * step
        probe.declined(now, recompute_s, probe_s)
        if probe.offer(now, "r", 0):
            assert probe.planned(len(at), "r", now)
            at.append(now)
            assert probe.result(len(at) - 1, now + probe_s, probe_s)
    return at


def test_a_slow_lane_s_probes_back_off_to_the_ceiling() -> None:
    """Plenty of declined hits (the credit is never short): each probe that leaves the
    lane declined doubles the gap to the next, up to MAX_BACKOFF_S."""
    at = run_slow_lane(hits_per_s=4, recompute_s=0.1, probe_s=0.001)
    gaps = [b - a for a, b in itertools.pairwise(at)]
    assert at[0] == FIRST_BACKOFF_S
    backoffs = [2.0, 4.0, 8.0, 16.0, 32.0] + [MAX_BACKOFF_S] * (len(gaps) - 5)
    # each gap: the backoff after the probe landed (1 ms), up to the next hit (250 ms)
    assert all(b < g <= b + 0.251 for g, b in zip(gaps, backoffs, strict=True))
    assert len(at) <= 6 + 3600 / MAX_BACKOFF_S  # an hour: 6 in the first 2 minutes, then 1/64 s


def test_a_slow_lane_s_probes_cost_a_share_of_what_it_declined() -> None:
    """Probes that cost more than the hits declined between them are spaced by the
    credit: their cost stays within PROBE_SHARE of the declined recompute time."""
    probe_s, recompute_s, hits_per_s = 2.0, 0.05, 10.0  # a read of 2 s; 0.5 s/s declined
    at = run_slow_lane(hits_per_s, recompute_s, probe_s)
    declined = 3600 * hits_per_s * recompute_s
    assert len(at) * probe_s <= PROBE_SHARE * declined + probe_s
    assert len(at) >= PROBE_SHARE * declined / probe_s - 2  # and no rarer than that
    assert not run_slow_lane(hits_per_s=1 / 600, recompute_s=0.05, probe_s=2.0)  # few hits


def test_nonsense_timings_count_for_nothing() -> None:
    probe = LaneProbe()
    probe.declined(0.0, math.nan, math.inf)
    assert probe.cost_s == 0.0 and probe.declined_s == 0.0
    assert probe.due(FIRST_BACKOFF_S)  # nothing to cover


# ------------------------------------------------------------ the lane's window


def test_a_probe_s_timing_starts_the_lane_s_window_again() -> None:
    """Among 32 slow samples one fast one would weigh a tenth; a probe's replaces them,
    so the lane is believed fast at once."""
    lane = LaneModel("disk")
    for _ in range(32):
        lane.observe(4, 4000, 4.0)  # 1 s per chunk
    moved = LaneModel("disk")
    for _ in range(32):
        moved.observe(4, 4000, 4.0)
    moved.observe(1, 1000, 0.001)  # one more sample: barely moves the estimate
    assert (moved.seconds(4) or 0.0) > 1.0
    lane.restart(1, 1000, 0.001)
    assert lane.samples == 1
    assert lane.seconds(4) == pytest.approx(0.004)


def test_a_restarted_window_keeps_the_lane_s_latency() -> None:
    """A one-chunk probe of a lane bound by its latency (a round trip) is not read as a
    cost per chunk: the latency fitted so far is the seed, clamped to the probe's time."""
    lane = LaneModel("redis")
    for chunks in (1, 2, 4, 8):
        lane.observe(chunks, 0, 0.002 + chunks * 0.5)  # 2 ms latency, slow transfer
    lane.restart(1, 0, 0.0021)  # fast again: 2 ms + 0.1 ms
    assert lane.seconds(4) == pytest.approx(0.0024)
    lane.restart(1, 0, 0.001)  # faster than the latency: clamped to it
    assert lane.seconds(4) == pytest.approx(0.001)
    lane.restart(0, 0, 1.0)  # nonsense is ignored
    lane.restart(1, 0, math.inf)
    assert lane.samples == 1
