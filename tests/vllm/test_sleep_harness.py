"""vLLM's sleep mode on vLLM's real scheduler (harness, sync and async; decision 0021):
the sleep sequence of vLLM 0.33 (abort, pause, the connector reset of a paused
scheduler, ``unregister_kv_caches``, the KV memory overwritten, ``restore_kv_caches``,
resume) keeps every tier when the weights are unchanged, and the woken engine loads
what it stored before; with weights changed while asleep nothing stored before is
loaded (the KV checks would catch a wrong chunk read)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvoffload.adapters.vllm.sleep_state import SleepPhase
from kvoffload.core.jobs import EngineJob, JobKind
from kvoffload.testing.vllm_harness import VllmHarness
from kvoffload.testing.vllm_harness.spec import HEAD_SIZE, HEADS, LAYERS
from kvoffload.tiers.disk import slot_bytes

PREFIX = list(range(10, 74))  # 64 tokens: 4 blocks of 16
MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]
CHUNK_BYTES = len(LAYERS) * HEADS * 16 * 2 * HEAD_SIZE * 4  # one block, all layers
FILLERS = [list(range(b, b + 64)) for b in (100, 200, 300)]


def finish(h: VllmHarness, request_id: str, prompt: list[int]) -> None:
    h.add_request(request_id, prompt, max_tokens=3)
    h.run()
    assert h.output_tokens(request_id) == h.model.reference_output(request_id, prompt, 3)


def phases(h: VllmHarness) -> set[SleepPhase]:
    return {child.side.sleep.phase for entry in h.ranks for child in entry.children}


def sleep_and_wake(h: VllmHarness, weights_changed: bool = False) -> None:
    h.sleep_engine(1)
    assert phases(h) == {SleepPhase.ASLEEP}
    h.wake_engine(weights_changed)
    assert phases(h) == {SleepPhase.AWAKE}


@pytest.mark.parametrize("async_scheduling", MODES)
@pytest.mark.parametrize("world_size", [1, 2])
def test_a_sleep_with_unchanged_weights_keeps_host_memory(
    make: Any, async_scheduling: bool, world_size: int
) -> None:
    h = make(async_scheduling=async_scheduling, world_size=world_size)
    finish(h, "a", PREFIX)
    sleep_and_wake(h)
    half = h.scheduler_half
    assert half.metrics.value("paused_resets_total") == 1
    assert half.metrics.value("resets_total") == 0  # no new epoch, nothing emptied
    finish(h, "b", [*PREFIX, 5, 6, 7])
    assert h.loaded_tokens("b") == 64 and h.loads_checked == 1
    assert half.metrics.value("weights_changes_total") == 0
    assert half.metrics.value("fenced_jobs_total", direction="load") == 0
    h.quiescent()


@pytest.mark.parametrize("async_scheduling", MODES)
def test_a_sleep_keeps_the_disk_tier(make: Any, tmp_path: Path, async_scheduling: bool) -> None:
    """The prefix's chunks live only on disk (host memory holds 8 chunks, fillers
    pushed them down); after the sleep the woken engine loads them from disk."""
    disk = {"disk_path": str(tmp_path / "disk"), "disk_bytes": 64 * slot_bytes(CHUNK_BYTES)}
    h = make(async_scheduling=async_scheduling, num_blocks=14, cpu_bytes=8 * CHUNK_BYTES,
             extra=disk)  # fmt: skip
    finish(h, "doc", PREFIX)
    for i, filler in enumerate(FILLERS):
        finish(h, f"filler{i}", filler)
    sleep_and_wake(h)
    finish(h, "again", [*PREFIX, 5, 6, 7])
    loads = [j for j in h.jobs_of(JobKind.LOAD) if j.request_id == "again"]
    assert h.loaded_tokens("again") == 64
    assert any(isinstance(j, EngineJob) and j.tier == "disk" for j in loads)
    assert h.loads_checked >= 1
    h.quiescent()


@pytest.mark.parametrize("async_scheduling", MODES)
def test_weights_changed_while_asleep_serve_no_chunk_from_before(
    make: Any, async_scheduling: bool
) -> None:
    """A level-2 sleep whose weights came back changed (an RL update while asleep):
    the sleep's reset asked for a check; the first plan after the wake-up is
    fingerprinted, its load planned under the old keys refused and recomputed."""
    h = make(async_scheduling=async_scheduling)
    finish(h, "a", PREFIX)
    h.sleep_engine(2)
    h.wake_engine(weights_changed=True)
    finish(h, "b", [*PREFIX, 5, 6, 7])  # the reference of the new weights
    half = h.scheduler_half
    assert h.loads_checked == 0  # nothing of before reached the engine
    assert half.metrics.value("fenced_jobs_total", direction="load") == 1
    assert half.metrics.value("weights_changes_total") == 1
    assert h.scheduler.reset_prefix_cache()  # vLLM forgets "b"'s blocks, kvoffload not
    finish(h, "c", [*PREFIX, 8, 9])  # what "b" stored under the new weights is found
    assert h.loaded_tokens("c") == 64 and h.loads_checked == 1
    h.quiescent()


def test_under_multiconnector_the_sleep_keeps_the_tiers(make: Any) -> None:
    h = make(beside={"cpu_bytes": 1 << 20})
    finish(h, "a", PREFIX)
    sleep_and_wake(h)
    for unit in h.units:  # both kvoffload children saw the paused reset
        assert unit.side.scheduler.metrics.value("paused_resets_total") == 1
        assert unit.side.scheduler.metrics.value("resets_total") == 0
    finish(h, "b", [*PREFIX, 5, 6, 7])
    loads = [j for u in h.units for j in u.checks.jobs.values() if j.kind is JobKind.LOAD]
    assert sum(len(j.block_ids) for j in loads if isinstance(j, EngineJob)) == 4  # 64 tokens
    assert h.loads_checked >= 1
    h.quiescent()


def test_a_reset_of_a_running_scheduler_still_forgets_everything(make: Any) -> None:
    """An explicit clear (``reset_prefix_cache(reset_connector=True)`` while the
    scheduler runs) keeps decision 0005's meaning."""
    h = make()
    finish(h, "a", PREFIX)
    assert h.reset_prefix_cache(reset_connector=True)
    finish(h, "b", [*PREFIX, 5, 6, 7])
    assert h.loaded_tokens("b") == 0
    assert h.scheduler_half.metrics.value("resets_total") == 1
    assert h.scheduler_half.metrics.value("paused_resets_total") == 0
    h.quiescent()


def test_a_plan_while_asleep_has_its_loads_and_stores_refused(make: Any) -> None:
    """Were a step to run between unregister and restore, its engine copies would be
    refused (counted) rather than touch the released memory."""
    h = make()
    finish(h, "a", PREFIX)
    h.sleep_engine(1)
    h.scheduler.set_pause_state(h.scheduler.pause_state.UNPAUSED)  # steps, still asleep
    finish(h, "b", [*PREFIX, *range(500, 520)])  # its load refused: recomputed; a store too
    half = h.scheduler_half
    refused = half.metrics.value("sleep_refused_jobs_total", direction="load")
    assert refused == 1 and h.loads_checked == 0
    assert half.metrics.value("sleep_refused_jobs_total", direction="store") >= 1
    h.wake_engine()
    assert h.scheduler.reset_prefix_cache()
    finish(h, "c", [*PREFIX, 8, 9])  # the chunks of before are still good
    assert h.loaded_tokens("c") == 64 and h.loads_checked == 1
    h.quiescent()
