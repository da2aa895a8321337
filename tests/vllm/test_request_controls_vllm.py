"""Per-request controls (``kv_transfer_params["kvoffload"]``) on vLLM's real
scheduler, synchronous and really asynchronous. The harness checks every read of
every forward pass, so a control that loaded the wrong KV would fail here too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvoffload.core.jobs import JobKind
from kvoffload.core.observe.metrics_view import read_metrics
from kvoffload.testing.vllm_harness import VllmHarness
from kvoffload.testing.vllm_harness.spec import HEAD_SIZE, HEADS, LAYERS
from kvoffload.tiers.disk import slot_bytes

MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]
BLOCK = 16
CHUNK_BYTES = len(LAYERS) * HEADS * BLOCK * 2 * HEAD_SIZE * 4
DOC = list(range(10, 74))  # 64 tokens: 4 chunks of one block
FILLERS = [list(range(b, b + 64)) for b in (100, 200, 300)]


@pytest.fixture(params=MODES)
def harness(request: pytest.FixtureRequest, tiny_model: Path) -> Iterator[Any]:
    made: list[VllmHarness] = []

    def build(**kwargs: Any) -> VllmHarness:
        h = VllmHarness(tiny_model, async_scheduling=request.param, **kwargs)
        made.append(h)
        return h

    yield build
    for h in made:
        h.close()


def serve(h: VllmHarness, request_id: str, prompt: list[int], params: Any = None) -> None:
    h.add_request(request_id, prompt, 2, kv_transfer_params=params)
    h.run()
    h.reset_prefix_cache()  # the engine forgets: whatever the next request hits is kvoffload's


def stored_by(h: VllmHarness, request_id: str) -> int:
    return sum(len(j.keys) for j in h.jobs_of(JobKind.STORE) if j.request_id == request_id)


def test_store_load_and_their_token_caps(harness: Any) -> None:
    h = harness()
    serve(h, "private", DOC + [1], {"kvoffload": {"store": False}})
    assert stored_by(h, "private") == 0
    serve(h, "after-private", DOC + [2])
    assert h.loaded_tokens("after-private") == 0  # nothing of the private request
    assert stored_by(h, "after-private") == 4
    serve(h, "no-load", DOC + [3], {"kvoffload": {"load": False}})
    assert h.loaded_tokens("no-load") == 0
    serve(h, "capped", DOC + [4], {"kvoffload": {"max_load_tokens": 40}})
    assert h.loaded_tokens("capped") == 32  # the chunks within its first 40 tokens
    serve(h, "other-doc", FILLERS[0] + [5], {"kvoffload": {"max_store_tokens": 33}})
    assert stored_by(h, "other-doc") == 2
    serve(h, "full", DOC + [6], {"do_remote_prefill": False})  # another connector's key
    assert h.loaded_tokens("full") == 64
    h.quiescent()


def test_a_bad_value_serves_the_request_without_offloading_and_counts_it(harness: Any) -> None:
    h = harness()
    serve(h, "doc", DOC + [1])
    bad = {"kvoffload": {"max_load_tokens": "all"}}
    serve(h, "bad", DOC + [2], bad)
    assert h.loaded_tokens("bad") == 0 and stored_by(h, "bad") == 0
    assert h.output_tokens("bad") == h.model.reference_output("bad", DOC + [2], 2)
    counters = read_metrics(h.scheduler_half, CHUNK_BYTES).counters
    assert counters[("request_param_errors_total", (("field", "kvoffload.max_load_tokens"),))] == 1
    h.quiescent()


def test_load_tiers_limits_the_tiers_a_hit_is_promoted_from(harness: Any, tmp_path: Path) -> None:
    disk = {"disk_path": str(tmp_path / "disk"), "disk_bytes": 64 * slot_bytes(CHUNK_BYTES)}
    h = harness(cpu_bytes=4 * CHUNK_BYTES, extra=disk)
    serve(h, "doc", DOC + [1])
    for i, filler in enumerate(FILLERS):
        serve(h, f"filler{i}", filler)  # DOC now lives on disk only
    serve(h, "host-only", DOC + [2], {"kvoffload": {"load_tiers": ["host"]}})
    assert h.loaded_tokens("host-only") == 0
    assert not [j for j in h.jobs_of(JobKind.PROMOTE) if j.request_id == "host-only"]
    serve(h, "from-disk", DOC + [3], {"kvoffload": {"load_tiers": ["host", "disk"]}})
    assert h.loaded_tokens("from-disk") == 64
    h.quiescent()
