"""A tier read that hangs past its deadline, on vLLM's real scheduler (the harness,
in logical time) and on a real engine (a disk read blocked on an event): the request
recomputes, its output equals the reference, the chunks stay in the tier, and the
late return writes nothing the engine or another job uses."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from hang_support import HangReads
from llm_support import CHUNK_BYTES, PROMPTS, counted, engine, generate, quiescent, settle, tokens

from kvoffload.core.jobs import JobKind
from kvoffload.testing.vllm_harness import CompleteAll, VllmHarness
from kvoffload.testing.vllm_harness.harness import SECONDS_PER_STEP
from kvoffload.testing.vllm_harness.spec import HEAD_SIZE, HEADS, LAYERS
from kvoffload.tiers.disk import DiskStore, slot_bytes

MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]
HARNESS_CHUNK = len(LAYERS) * HEADS * 16 * 2 * HEAD_SIZE * 4  # one block of 16 tokens
DOC = list(range(10, 74))  # 4 chunks of one block
FILLERS = [list(range(b, b + 64)) for b in (100, 200, 300)]
DEADLINE_STEPS = 10


@pytest.fixture
def harness(make: Any, tmp_path: Path) -> Any:
    def build(async_scheduling: bool, loads: str) -> VllmHarness:
        extra = {
            "disk_path": str(tmp_path / "disk"),
            "disk_bytes": 64 * slot_bytes(HARNESS_CHUNK),
            "lower_tier_loads": loads,
            "tier_io_timeout_ms": round(DEADLINE_STEPS * SECONDS_PER_STEP * 1000),
            "tier_threads": 1,
        }
        harness: VllmHarness = make(
            async_scheduling=async_scheduling, cpu_bytes=4 * HARNESS_CHUNK, extra=extra
        )
        return harness

    return build


def serve(h: VllmHarness, request_id: str, prompt: list[int]) -> None:
    h.add_request(request_id, prompt, 2)
    h.run()


@pytest.mark.parametrize("async_scheduling", MODES)
@pytest.mark.parametrize(("loads", "kind"), [("direct", "load"), ("promote", "promote")])
def test_a_tier_read_hung_past_its_deadline_ends_in_recompute(
    harness: Any, async_scheduling: bool, loads: str, kind: str
) -> None:
    h: VllmHarness = harness(async_scheduling, loads)
    serve(h, "doc", DOC)
    for i, filler in enumerate(FILLERS):  # DOC's chunks now live only on disk
        serve(h, f"filler{i}", filler)
    h.reset_prefix_cache()
    policy = HangReads(harness=h, kinds=(JobKind(kind),))
    h.policy = policy
    h.add_request("doc2", DOC, 2)
    for _ in range(5 * DEADLINE_STEPS):
        if "doc2" not in h.scheduler.requests:
            break
        h.step()
    assert "doc2" not in h.scheduler.requests, "the request waited past the deadline"
    assert policy.hung and h.hangs.parked(0)  # the read is still out
    want = h.model.reference_output("doc2", DOC, 2)
    assert h.output_tokens("doc2") == want  # recomputed
    half = h.scheduler_half
    disk = half.tiers.tier("disk")
    assert disk.metrics.value("tier_io_timeouts_total", direction=kind) == 1
    if kind == "promote":  # its host slots wait for the read: held, not reused
        assert half.moves.quarantine.chunks("disk") > 0 and half.has_pending_work()
    h.release_hangs()  # the read returns, late: no engine block, no reused slot
    h.policy = CompleteAll()
    h.run()
    assert not half.moves.quarantine
    serve(h, "doc3", DOC)  # the chunks were kept: served from disk this time
    assert h.output_tokens("doc3") == h.model.reference_output("doc3", DOC, 2)
    assert h.loaded_tokens("doc3") > 0
    h.quiescent()


# ------------------------------------------------------------ a real engine


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> list[int]:
    with engine(tiny_model, None) as llm:
        return tokens(generate(llm, [PROMPTS[0]]))[0]


def test_a_hung_disk_read_ends_in_recompute_within_the_deadline(
    tiny_model: Path, tmp_path: Path, reference: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk's read blocks on an event (a dying disk, a stalled mount) that the test
    sets at the end: the load fails at its 200 ms deadline and vLLM recomputes."""
    release = threading.Event()
    hang = threading.Event()
    read_into = DiskStore.read_into

    def blocking(self: DiskStore, *args: Any, **kwargs: Any) -> None:
        if hang.is_set():
            release.wait()
        read_into(self, *args, **kwargs)

    monkeypatch.setattr(DiskStore, "read_into", blocking)
    extra = {
        "cpu_bytes": 8 * CHUNK_BYTES,
        "disk_path": str(tmp_path / "disk"),
        "disk_bytes": 256 * (CHUNK_BYTES + 64),
        "tier_io_timeout_ms": 200,
    }
    try:
        with engine(tiny_model, extra) as llm:
            for prompt in PROMPTS:  # host memory holds 8 chunks: PROMPTS[0] only on disk
                generate(llm, [prompt])
                settle(llm)
            llm.reset_prefix_cache()
            hang.set()
            again = generate(llm, [PROMPTS[0]])[0]
            assert list(again.outputs[0].token_ids) == reference
            assert again.num_cached_tokens == 0  # recomputed
            assert counted(llm, "tier_io_timeouts_total", direction="load", tier="disk") == 1
            release.set()
            settle(llm)
            quiescent(llm)
            hang.clear()
            served = generate(llm, [PROMPTS[0]])[0]  # the chunks were kept
            assert list(served.outputs[0].token_ids) == reference
            assert served.num_cached_tokens == len(PROMPTS[0])
            settle(llm)
    finally:
        release.set()
