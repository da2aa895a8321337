"""Weights updated in place, on vLLM's real scheduler (harness, sync and async;
decision 0019): after vLLM's default prefix-cache reset every worker fingerprints its
weights before the next plan's jobs and refuses the loads it planned under the old
keys (the fence), and nothing stored under the old weights is loaded afterwards;
unchanged weights keep their chunks; weights loaded anew with no reset are fingerprinted
by the workers on their own."""

from __future__ import annotations

import pytest

from kvoffload.core.identity.weights import WeightsPhase
from kvoffload.testing.vllm_harness import VllmHarness

PREFIX = list(range(10, 74))  # 64 tokens: 4 blocks of 16
MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]


def finish(h: VllmHarness, request_id: str, prompt: list[int]) -> None:
    h.add_request(request_id, prompt, max_tokens=3)
    h.run()
    want = h.model.reference_output(request_id, prompt, 3)
    assert h.output_tokens(request_id) == want


@pytest.mark.parametrize("async_scheduling", MODES)
@pytest.mark.parametrize("world_size", [1, 2])
def test_an_update_with_the_default_reset_loads_nothing_stored_before(
    make, async_scheduling: bool, world_size: int
) -> None:  # type: ignore[no-untyped-def]
    h = make(async_scheduling=async_scheduling, world_size=world_size)
    half = h.scheduler_half
    assert half.weights.phase is WeightsPhase.KNOWN  # the handshake, before any step
    finish(h, "a", PREFIX)
    assert h.update_weights()  # weights changed in place, then reset_prefix_cache()
    finish(h, "b", [*PREFIX, 5, 6, 7])  # planned under the old keys: refused, recomputed
    assert half.metrics.value("fenced_jobs_total", direction="load") == 1
    assert h.loads_checked == 0  # the refused load copied nothing into "b"'s blocks
    assert half.metrics.value("weights_changes_total") == 1
    assert h.scheduler.reset_prefix_cache()  # vLLM forgets "b"'s blocks, kvoffload not
    finish(h, "c", [*PREFIX, 8, 9])  # what "b" stored under the new weights is found
    assert h.loaded_tokens("c") == 64 and h.loads_checked == 1
    h.quiescent()


@pytest.mark.parametrize("async_scheduling", MODES)
def test_a_default_reset_with_unchanged_weights_keeps_every_chunk(
    make, async_scheduling: bool
) -> None:  # type: ignore[no-untyped-def]
    h = make(async_scheduling=async_scheduling)
    finish(h, "a", PREFIX)
    assert h.scheduler.reset_prefix_cache()  # a benchmark's reset: same weights
    finish(h, "b", [*PREFIX, 5, 6, 7])
    assert h.loaded_tokens("b") == 64  # not even a step of waiting
    half = h.scheduler_half
    assert half.metrics.value("deferrals_total", reason="weights") == 0
    assert half.metrics.value("weights_checks_total") == 1
    assert half.metrics.value("weights_changes_total") == 0
    h.quiescent()


@pytest.mark.parametrize("async_scheduling", MODES)
def test_weights_loaded_anew_with_no_reset_are_fingerprinted_by_the_workers(
    make, async_scheduling: bool
) -> None:  # type: ignore[no-untyped-def]
    """``reload_weights`` (the model's ``load_weights``) while vLLM's cache holds
    nothing of the prompt: the workers fingerprint on their own, refuse the load
    planned under the old keys, and report; the scheduler half moves the keys."""
    h = make(async_scheduling=async_scheduling)
    finish(h, "a", PREFIX)
    assert h.scheduler.reset_prefix_cache()  # same weights: vLLM's cache emptied
    h.load_weights()  # no reset: the scheduler half is not told
    finish(h, "b", [*PREFIX, 5, 6, 7])  # recomputed: the answer of the new weights
    half = h.scheduler_half
    assert half.metrics.value("fenced_jobs_total", direction="load") == 1
    assert h.loads_checked == 0
    assert half.metrics.value("weights_changes_total") == 1
    assert h.scheduler.reset_prefix_cache()
    finish(h, "c", [*PREFIX, 8, 9])
    assert h.loaded_tokens("c") == 64  # stored under the new weights, found again
    h.quiescent()


def test_under_multiconnector_the_weights_come_with_the_first_report(make) -> None:  # type: ignore[no-untyped-def]
    """No handshake beside a P/D connector: the first lookups wait a step for the
    workers' first report, then load as usual."""
    h = make(beside={"cpu_bytes": 1 << 20})
    half = h.scheduler_half
    assert half.weights.phase is WeightsPhase.UNKNOWN
    finish(h, "a", PREFIX)
    assert half.weights.phase is WeightsPhase.KNOWN
    waits = [u.side.scheduler.metrics.value("deferrals_total", reason="weights") for u in h.units]
    assert sum(waits) >= 1  # the first lookup waited (MultiConnector asks in order)
    finish(h, "b", [*PREFIX, 5, 6, 7])
    h.quiescent()
