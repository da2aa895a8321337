"""Load or recompute (decision 0013) on vLLM's real scheduler, in logical time with
fixed lane costs (``HarnessSpec.lane_costs``): once the disk lane was timed slower than
the engine's prefill, a hit held on disk only is declined (the request recomputes at
once, its output equals the reference); a fast disk's hit is loaded."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload.core.cost import LaneCosts
from kvoffload.testing.vllm_harness import VllmHarness
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
def harness(tiny_model: Path, tmp_path: Path) -> Iterator[Any]:
    made: list[VllmHarness] = []

    def build(async_scheduling: bool, disk: LaneCosts) -> VllmHarness:
        extra = {"disk_path": str(tmp_path / "disk"), "disk_bytes": 64 * slot_bytes(CHUNK)}
        h = VllmHarness(
            tiny_model,
            async_scheduling=async_scheduling,
            cpu_bytes=4 * CHUNK,
            extra=extra,
            lane_costs={"disk": disk},
        )
        made.append(h)
        return h

    yield build
    for h in made:
        h.close()


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
