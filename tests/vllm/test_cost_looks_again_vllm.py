"""The cost model looks again (decision 0013) on vLLM's real scheduler, in logical time
with fixed lane costs: a disk lane that turned slow is declined, re-measured by probes
(one chunk of a hit each, spaced by a doubling backoff and by the credit of the hits
declined since), and loaded from again once its probe is due after the disk turned
fast; likewise a lane declined for a read that timed out at its deadline."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from hang_support import HangReads

from kvoffload.core.cost import LaneCosts, ProbeState, Verdict, fixed_timing
from kvoffload.core.cost.model import JobTiming, timed_out
from kvoffload.core.cost.probing import FIRST_BACKOFF_S, MAX_BACKOFF_S
from kvoffload.core.jobs import JobResult, TransferJob
from kvoffload.testing.vllm_harness import CompleteAll, VllmHarness
from kvoffload.testing.vllm_harness.harness import SECONDS_PER_STEP
from kvoffload.testing.vllm_harness.spec import HEAD_SIZE, HEADS, LAYERS
from kvoffload.tiers.disk import slot_bytes

MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]
CHUNK = len(LAYERS) * HEADS * 16 * 2 * HEAD_SIZE * 4  # one block of 16 tokens
DOC = list(range(10, 74))  # 4 chunks of one block
WHOLE, PROBE = 64, 16  # tokens of DOC a load moves: all of them, a probe's one chunk
FAST, SLOW = LaneCosts(0.0, 1e-5), LaneCosts(0.0, 0.02)  # DOC recomputes in ~20-40 ms
DEADLINE_STEPS = 10


class Round(NamedTuple):
    at: float  # logical time DOC's request arrived
    loaded: int  # its tokens loaded from the disk
    probes: int  # cost_probes_total{tier="disk"} after it


@pytest.fixture
def harness(make: Any, tmp_path: Path) -> Any:
    def build(async_scheduling: bool, **extra: Any) -> VllmHarness:
        h: VllmHarness = make(
            async_scheduling=async_scheduling,
            cpu_bytes=4 * CHUNK,
            extra={
                "disk_path": str(tmp_path / "disk"),
                "disk_bytes": 2048 * slot_bytes(CHUNK),  # never full: DOC stays
                "load_policy": "cost",
                **extra,
            },
            lane_costs={"disk": FAST},
        )
        return h

    return build


class Rounds:
    """DOC served again and again, each time after fillers pushed it out of host memory
    and the engine's prefix cache (the disk alone holds it)."""

    def __init__(self, h: VllmHarness) -> None:
        self.h = h
        self.played: list[Round] = []
        self._fillers = itertools.count()
        serve(h, "doc", DOC)

    def play(self) -> Round:
        h, r = self.h, len(self.played)
        for i in range(3):  # new each round: none hits the disk
            serve(h, f"filler{r}.{i}", [1000 - next(self._fillers), *DOC[1:]])
        h.reset_prefix_cache()
        at = h.clock
        serve(h, f"doc{r}", DOC)
        probes = h.scheduler_half.metrics.value("cost_probes_total", tier="disk")
        played = Round(at, h.loaded_tokens(f"doc{r}"), int(probes))
        self.played.append(played)
        return played


def serve(h: VllmHarness, request_id: str, prompt: list[int]) -> None:
    h.add_request(request_id, prompt, 2)
    h.run()
    assert h.output_tokens(request_id) == h.model.reference_output(request_id, prompt, 2)


def declined_then_probed(rounds: Rounds, probes: int) -> list[Round]:
    """Rounds from the lane's decline until ``probes`` probes were made; checks that
    only probes load there, one chunk each, the backoff between them doubling."""
    while rounds.play().loaded:
        assert len(rounds.played) < 20, "the slow lane was never declined"
    declined = rounds.played[-1]
    slow = [declined]
    while slow[-1].probes < probes:
        slow.append(rounds.play())
        assert len(slow) < 200, "never probed"
    probed = [r for r in slow if r.loaded]
    assert all(r.loaded == PROBE for r in probed)  # a probe loads one chunk
    assert [r.probes for r in probed] == list(range(1, len(probed) + 1))
    assert slow[-1].probes == len(probed)  # every probe counted, none else
    starts = [declined.at] + [r.at for r in probed]
    gaps = [b - a for a, b in itertools.pairwise(starts)]
    backoffs = [FIRST_BACKOFF_S * 2**i for i in range(len(gaps))]
    assert all(gap >= backoff for gap, backoff in zip(gaps, backoffs, strict=True))
    return probed


def loads_again(rounds: Rounds, timing: JobTiming) -> None:
    """The disk turns fast (``timing``): plays rounds until it loads whole again. Checks
    that DOC is declined until its probe is due (at the latest, the first round that
    starts with the probe due is the probe: one chunk), the time part of which is at
    most one backoff after the turn, and that every later round loads whole."""
    h = rounds.h
    h.scheduler_half.cost.timing = timing
    probe = h.scheduler_half.cost.probes["disk"]
    assert probe.state is ProbeState.WAITING
    assert probe.due_at - h.clock <= probe.backoff_s <= MAX_BACKOFF_S
    while True:
        due = probe.due(h.clock)  # then it is due at DOC's lookup too (later, no credit less)
        played = rounds.play()
        if played.loaded:
            break
        assert not due, "a probe due was not taken"
        assert len(rounds.played) < 200, "never probed"
    assert played.loaded == PROBE  # the probe: one chunk
    assert rounds.play().loaded == WHOLE  # the probe said fast: the lane loads whole again
    assert h.scheduler_half.cost.verdicts["disk"] is Verdict.LOAD
    assert probe.state is ProbeState.IDLE and probe.backoff_s == FIRST_BACKOFF_S
    assert rounds.play().loaded == WHOLE


@pytest.mark.parametrize("async_scheduling", MODES)
def test_a_disk_that_turned_slow_then_fast_is_loaded_from_again(
    harness: Any, async_scheduling: bool
) -> None:
    h: VllmHarness = harness(async_scheduling)
    rounds = Rounds(h)
    for _ in range(3):
        assert rounds.play().loaded == WHOLE  # fast: every hit loaded
    h.scheduler_half.cost.timing = fixed_timing({"disk": SLOW})
    probed = declined_then_probed(rounds, 2)
    assert len(probed) == 2
    loads_again(rounds, fixed_timing({"disk": FAST}))
    h.quiescent()


def deadline_or(costs: LaneCosts) -> JobTiming:
    """The lane's fixed cost, except that a read that timed out counts for its deadline
    (the seconds the worker reports for it), as the engine's measured timing does."""
    fixed = fixed_timing({"disk": costs})

    def timing(job: TransferJob, result: JobResult) -> float:
        return result.seconds if timed_out(result) else fixed(job, result)

    return timing


@pytest.mark.parametrize("async_scheduling", MODES)
def test_a_disk_declined_for_a_timed_out_read_is_probed_again(
    harness: Any, async_scheduling: bool
) -> None:
    """One disk read hangs past its deadline (200 ms, counted for the deadline: slower
    than recomputing DOC): the lane is declined. The disk is fine again, so the probe,
    once due, lands fast and the lane loads again."""
    deadline_ms = round(DEADLINE_STEPS * SECONDS_PER_STEP * 1000)
    h: VllmHarness = harness(async_scheduling, tier_io_timeout_ms=deadline_ms, tier_threads=1)
    rounds = Rounds(h)
    assert rounds.play().loaded == WHOLE
    h.scheduler_half.cost.timing = deadline_or(FAST)
    h.policy = policy = HangReads(harness=h, left=1)
    assert rounds.play().loaded == WHOLE  # planned, then failed at its deadline
    assert policy.hung and h.scheduler_half.cost.lane("disk").samples == 2
    disk = h.scheduler_half.tiers.tier("disk")
    assert disk.metrics.value("tier_io_timeouts_total", direction="load") == 1
    h.release_hangs()
    h.policy = CompleteAll()
    assert not declined_then_probed(rounds, 0)
    loads_again(rounds, deadline_or(FAST))
    h.quiescent()
