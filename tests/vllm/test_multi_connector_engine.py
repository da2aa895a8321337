"""kvoffload inside vLLM's MultiConnector on a real in-process engine (tiny Llama,
float32, greedy): the two repros of the deployment-shapes issue. Two kvoffload
instances stand in for a P/D connector beside kvoffload (what runs on CPU): the
first child loads whenever it has a hit, kvoffload under test is the second."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llm_support import CHUNK_BYTES, PROMPTS, engine, generate, halves, settle, tokens

from kvoffload.adapters.vllm.worker_side import WorkerSide
from kvoffload.core.jobs import EngineJob, JobKind
from kvoffload.testing.vllm_cpu import kvoffload_transfer


def multi(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """A MultiConnector config as a user writes it (no load-failure policy set)."""
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "connectors": [kvoffload_transfer(first), kvoffload_transfer(second)]
        },
    }


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> dict[int, list[int]]:
    with engine(tiny_model, None) as llm:
        return {i: t for i, t in enumerate(tokens(generate(llm, PROMPTS)))}


def test_a_damaged_disk_chunk_under_multiconnector_is_recomputed(
    tiny_model: Path, tmp_path: Path, reference: dict[int, list[int]]
) -> None:
    """Before: ``Failing 1 request(s) due to KV load failure (failure_policy=fail)``,
    an empty output, while the start-up line claimed ``recompute``."""
    from kvoffload.tiers.disk import PAYLOAD_OFFSET, slot_bytes
    from kvoffload.tiers.slab_format import SUPERBLOCK_BYTES

    ours = {
        "cpu_bytes": 8 * CHUNK_BYTES,
        "disk_path": str(tmp_path / "disk"),
        "disk_bytes": 256 * (CHUNK_BYTES + 64),
    }
    first = {"cpu_bytes": CHUNK_BYTES}  # one chunk: never a prefix hit
    with engine(tiny_model, None, transfer=multi(first, ours)) as llm:
        core = llm.llm_engine.engine_core.engine_core
        assert type(core.scheduler.connector).__name__ == "MultiConnector"
        assert core.scheduler.recompute_kv_load_failures
        for p in PROMPTS:  # prompt 0's chunks end up on disk only
            generate(llm, [p])
            settle(llm)
        llm.reset_prefix_cache()
        half = halves(llm)[-1]
        disk = half.tiers.tier("disk").directory
        slots = [disk.slot_of(k) for k in disk.present_keys()]
        (slab,) = (tmp_path / "disk").rglob("slab.r0")
        with open(slab, "r+b") as f:
            for slot in slots:
                offset = SUPERBLOCK_BYTES + slot * slot_bytes(CHUNK_BYTES) + PAYLOAD_OFFSET + 100
                f.seek(offset)
                byte = f.read(1)
                f.seek(offset)
                f.write(bytes([byte[0] ^ 1]))
        again = generate(llm, [PROMPTS[0]])[0]
        assert again.outputs[0].finish_reason != "error"
        assert list(again.outputs[0].token_ids) == reference[0]
        settle(llm)
        errors = half.tiers.tier("disk").metrics.breakdown("integrity_errors_total", "reason")
        assert errors.get("checksum", 0) >= 1  # the damaged chunk was read, and recomputed


class StoreGate:
    """A copy hook on one kvoffload worker: its store copies wait (a busy copy
    stream) until the test opens the gate or a plan flushes them; loads pass."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.allowed: set[int] = set()
        self.opened = False
        self.held_ever = 0

    def __call__(self, job: EngineJob) -> None:
        if job.kind is not JobKind.STORE:
            return
        with self.cv:
            self.held_ever += 1
            self.cv.wait_for(lambda: self.opened or job.job_id in self.allowed, timeout=120)

    def release(self, ids: set[int]) -> None:
        with self.cv:
            self.allowed |= ids
            self.cv.notify_all()

    def open(self) -> None:
        with self.cv:
            self.opened = True
            self.cv.notify_all()


@pytest.fixture
def slow_second_store(monkeypatch: pytest.MonkeyPatch) -> Iterator[StoreGate]:
    """Hold the store copies of the worker whose config names ``cpu_bytes`` of the
    second child (``SLOW_BYTES``); its flushes release what they wait for."""
    gate = StoreGate()
    init = WorkerSide.__init__
    flush_of = WorkerSide.handle_preemptions

    def patched_init(self: WorkerSide, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if self.config.cpu_bytes == SLOW_BYTES:
            self.copy_hook = gate

    def patched_flush(self: WorkerSide, metadata: Any) -> None:
        if self.copy_hook is gate:
            gate.release(set(metadata.plan.flush))
        flush_of(self, metadata)

    monkeypatch.setattr(WorkerSide, "__init__", patched_init)
    monkeypatch.setattr(WorkerSide, "handle_preemptions", patched_flush)
    try:
        yield gate
    finally:
        gate.open()


SLOW_BYTES = 64 * CHUNK_BYTES + 1


def test_another_connector_s_load_never_lands_under_an_unread_store(
    tiny_model: Path, reference: dict[int, list[int]], slow_second_store: StoreGate
) -> None:
    """The first child (stores after two lookups) holds prompt 1; kvoffload under
    test (second) stores every prompt, its store copies slowed. Prompt 0 runs and
    finishes while kvoffload's stores of it are unread; prompt 1 is then served by
    the first child's load into the blocks prompt 0 freed. Before: kvoffload's
    late store read prompt 1's KV and stored it under prompt 0's keys, and prompt 0
    later got wrong tokens from it."""
    first = {"cpu_bytes": 64 * CHUNK_BYTES, "store_threshold": 2}
    ours = {"cpu_bytes": SLOW_BYTES}
    gate = slow_second_store
    # 10 blocks: prompt 1 (8 blocks + its tail) must take most of prompt 0's.
    with engine(
        tiny_model, None, transfer=multi(first, ours), kv_blocks=11, max_model_len=320
    ) as llm:
        for _ in range(2):  # two lookups: the first child stores prompt 1
            generate(llm, [PROMPTS[1]])
            gate.open()
            settle(llm)
            llm.reset_prefix_cache()
        gate.opened = False
        slow, fast = halves(llm)[-1], halves(llm)[0]
        first_hits = fast.stats.loads
        held_before = gate.held_ever
        assert tokens(generate(llm, [PROMPTS[0]])) == [reference[0]]
        assert gate.held_ever > held_before  # kvoffload's stores of prompt 0 wait
        assert any(j.kind is JobKind.STORE for j in slow.jobs_in_flight())
        llm.reset_prefix_cache()
        assert tokens(generate(llm, [PROMPTS[1]])) == [reference[1]]
        assert fast.stats.loads > first_hits  # the first child served prompt 1
        gate.open()
        settle(llm)
        llm.reset_prefix_cache()
        served_before = slow.stats.loads
        again = generate(llm, [PROMPTS[0]])[0]
        assert slow.stats.loads > served_before  # kvoffload's own copy of prompt 0
        assert again.num_cached_tokens > 0
        assert list(again.outputs[0].token_ids) == reference[0]
        settle(llm)
