"""Workers' reports delivered a step late, merged with the next step's (vLLM 0.33's
fault tolerance: a failed step's connector outputs are replayed with the next
aggregate): every job still completes once, every load is checked, the outputs are
the reference model's, and the scheduler half ends quiescent."""

from __future__ import annotations

from typing import Any

import pytest

MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]
PREFIX = list(range(10, 74))  # 64 tokens: 4 blocks of 16


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("async_scheduling", MODES)
def test_reports_deferred_a_step_stay_correct(
    make: Any, async_scheduling: bool, world_size: int
) -> None:
    h = make(async_scheduling=async_scheduling, world_size=world_size)
    h.add_request("a", PREFIX, max_tokens=4)
    for _ in range(40):  # defer every other step's reports while a stores
        h.outputs_in.defer_next = 1
        h.step()
        h.step()
        if not h.busy():
            break
    h.run()
    h.reset_prefix_cache()
    h.add_request("b", [*PREFIX, 5, 6, 7], max_tokens=3)
    h.outputs_in.defer_next = 3  # b's load reported three steps late
    h.run()
    assert h.outputs_in.deferred >= 4  # the mode this test claims
    for rid, prompt, n in (("a", PREFIX, 4), ("b", [*PREFIX, 5, 6, 7], 3)):
        assert h.output_tokens(rid) == h.model.reference_output(rid, prompt, n)
    assert h.loads_checked == 1  # b's four chunks, loaded and checked once
    assert h.scheduler_half.metrics.value("hit_tokens_total", tier="host") == 64
    half = h.scheduler_half
    assert half.jobs_in_flight() == [] and half.request_ids() == []
    half.check_integrity()
