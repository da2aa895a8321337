"""Load or recompute (decision 0013) on vLLM's real scheduler, in logical time with
fixed lane costs (``HarnessSpec.lane_costs``): once the disk lane was timed slower than
the engine's prefill, a hit held on disk only is declined (the request recomputes at
once, its output equals the reference); a fast disk's hit is loaded; tier loads held in
flight queue on the lane until a hit is declined for the queue, and once they land the
lane loads again."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvoffload.core.cost import LaneCosts, fixed_timing
from kvoffload.core.jobs import JobKind, TransferJob
from kvoffload.testing.vllm_harness import CompleteAll, VllmHarness
from kvoffload.testing.vllm_harness.spec import HEAD_SIZE, HEADS, LAYERS
from kvoffload.tiers.disk import slot_bytes

MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]
CHUNK = len(LAYERS) * HEADS * 16 * 2 * HEAD_SIZE * 4  # one block of 16 tokens
DOC = list(range(10, 74))  # 4 chunks of one block
FILLERS = [
    [list(range(b, b + 64)) for b in (100, 200, 300)],
    [list(range(b, b + 64)) for b in (400, 500, 600)],
]


@pytest.fixture
def harness(make: Any, tmp_path: Path) -> Any:
    def build(async_scheduling: bool, disk: LaneCosts) -> VllmHarness:
        extra = {
            "disk_path": str(tmp_path / "disk"),
            "disk_bytes": 64 * slot_bytes(CHUNK),
            "load_policy": "cost",
        }
        harness: VllmHarness = make(
            async_scheduling=async_scheduling,
            cpu_bytes=4 * CHUNK,
            extra=extra,
            lane_costs={"disk": disk},
        )
        return harness

    return build


def serve(h: VllmHarness, request_id: str, prompt: list[int]) -> None:
    h.add_request(request_id, prompt, 2)
    h.run()
    assert h.output_tokens(request_id) == h.model.reference_output(request_id, prompt, 2)


def evict_doc(h: VllmHarness, round_: int) -> None:
    """DOC's chunks leave host memory and the engine's prefix cache: the disk alone
    holds them."""
    for i, filler in enumerate(FILLERS[round_]):  # new each round: none hits the disk
        serve(h, f"filler{round_}.{i}", filler)
    h.reset_prefix_cache()


@pytest.mark.parametrize("async_scheduling", MODES)
@pytest.mark.parametrize(("per_chunk", "loaded"), [(1.0, False), (1e-5, True)])
def test_a_slow_disk_s_hit_is_recomputed_and_a_fast_one_loaded(
    harness: Any, async_scheduling: bool, per_chunk: float, loaded: bool
) -> None:
    h: VllmHarness = harness(async_scheduling, LaneCosts(0.0, per_chunk))
    half = h.scheduler_half
    serve(h, "doc", DOC)
    evict_doc(h, 0)
    serve(h, "doc2", DOC)  # the disk lane is unmeasured: loaded, as always
    assert h.loaded_tokens("doc2") > 0
    assert half.cost.lane("disk").samples >= 1
    evict_doc(h, 1)
    serve(h, "doc3", DOC)
    declined = half.metrics.value("hits_declined_total", tier="disk", reason="transfer")
    if loaded:
        assert h.loaded_tokens("doc3") > 0 and declined == 0
    else:
        assert h.loaded_tokens("doc3") == 0 and declined >= 1
        assert half.metrics.value("deferral_timeouts_total") == 0  # never waited for
    assert half.metrics.value("declined_tokens_total", tier="disk") == (0 if loaded else 64)
    h.quiescent()


@dataclass
class HoldTierLoads(CompleteAll):
    """Every job completes at once, except tier loads while ``hold``."""

    hold: bool = True

    def tier_jobs(
        self, rank: int, step: int, jobs: Sequence[TransferJob]
    ) -> tuple[set[int], set[int]]:
        held = {j.job_id for j in jobs if self.hold and j.kind is JobKind.LOAD}
        return {j.job_id for j in jobs} - held, set()


@pytest.mark.parametrize("async_scheduling", MODES)
def test_a_growing_queue_declines_and_a_drained_one_loads_again(
    harness: Any, async_scheduling: bool
) -> None:
    """The disk lane is cheap idle; tier loads held in flight queue on it until loading
    is slower than recomputing (declined: ``queue``); once they land it loads again."""
    h: VllmHarness = harness(async_scheduling, LaneCosts(0.0, 0.0))
    half = h.scheduler_half
    serve(h, "doc", DOC)
    evict_doc(h, 0)
    rate = half.cost.prefill.tokens_per_s()
    # One load of DOC: half of recomputing it. While other requests share the engine a
    # load is taken up to twice the recompute time (SHARED_ENGINE_WEIGHT): the fifth
    # load queued on the lane is declined.
    per_chunk = 0.5 * len(DOC) / rate / 4
    half.cost.timing = fixed_timing({"disk": LaneCosts(0.0, per_chunk)})
    serve(h, "probe", DOC)  # measures the lane
    assert h.loaded_tokens("probe") > 0
    evict_doc(h, 1)
    h.policy = policy = HoldTierLoads()
    waiting = []
    for i in range(30):
        rid = f"q{i}"
        h.add_request(rid, DOC, 2)
        h.step()
        h.step()
        if half.metrics.value("hits_declined_total", tier="disk", reason="queue"):
            break
        waiting.append(rid)
    assert half.metrics.value("hits_declined_total", tier="disk", reason="queue") == 1
    assert h.loaded_tokens(rid) == 0  # recomputed at once
    assert all(h.loaded_tokens(w) > 0 for w in waiting)
    policy.hold = False
    h.run()
    assert half.cost.queued_chunks("disk") == 0
    h.reset_prefix_cache()
    serve(h, "after", DOC)
    assert h.loaded_tokens("after") > 0
    for rid in [*waiting, f"q{len(waiting)}"]:
        assert h.output_tokens(rid) == h.model.reference_output(rid, DOC, 2)
    h.quiescent()
