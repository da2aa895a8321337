"""One engine per disk tier namespace, with vLLM's real configs: a second engine of
the same model on one ``disk_path`` is refused at start in one line and the first keeps
its chunks; another model shares the directory; shutdown releases the lock.

Two in-process ``LLM`` engines cannot be alive at once (vLLM keeps one worker-role
connector per process and would hand engine A's to engine B), so the second engine's
start is its scheduler-role connector built from the first engine's own configs: what
engine B's engine core builds. The harness tests run vLLM's real scheduler."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llm_support import CHUNK_BYTES, PROMPTS, counted, engine, generate, settle, tokens

from kvoffload.adapters.vllm.compat import KVConnectorRole
from kvoffload.adapters.vllm.connector import KVOffloadConnector
from kvoffload.core.errors import ConfigError
from kvoffload.testing.vllm_harness import VllmHarness
from kvoffload.testing.vllm_harness.spec import HEAD_SIZE, HEADS, LAYERS
from kvoffload.tiers.disk import slot_bytes
from kvoffload.tiers.disk_lock import DiskLock

REFUSED = r"kvoffload config 'disk_path': .* is in use by another engine \(pid \d+ on host "


def second_engines_connector(llm: Any) -> KVOffloadConnector:
    """The scheduler-role connector another engine with ``llm``'s configs starts with."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    return KVOffloadConnector(
        scheduler.vllm_config, KVConnectorRole.SCHEDULER, scheduler.kv_cache_config
    )


def test_a_second_engine_is_refused_and_the_first_keeps_its_disk_chunks(
    tiny_model: Path, tmp_path: Path
) -> None:
    disk = tmp_path / "disk"
    extra = {
        "cpu_bytes": 8 * CHUNK_BYTES,
        "disk_path": str(disk),
        "disk_bytes": 64 * (CHUNK_BYTES + 8192),
    }
    with engine(tiny_model, extra) as llm:
        first = tokens(generate(llm, [PROMPTS[0]]))
        settle(llm)
        with pytest.raises(ConfigError, match=REFUSED) as refused:
            second_engines_connector(llm)
        assert "\n" not in str(refused.value) and str(disk) in str(refused.value)
        for p in PROMPTS[1:3]:  # host memory (8 chunks) now holds only these
            generate(llm, [p])
            settle(llm)
        llm.reset_prefix_cache()
        again = generate(llm, [PROMPTS[0]])[0]
        assert again.num_cached_tokens == len(PROMPTS[0])  # every chunk, from disk
        assert tokens([again]) == first
        assert counted(llm, "hit_tokens_total", tier="disk") == len(PROMPTS[0])
        settle(llm)
    restarted = second_engines_connector(llm)  # the first engine's shutdown released it
    restarted.shutdown()


class Harnesses:
    """Harnesses a test builds, each closed once: by the test or at its end."""

    def __init__(self) -> None:
        self.open: list[VllmHarness] = []

    def build(self, model: Path, **kwargs: Any) -> VllmHarness:
        h = VllmHarness(model, **kwargs)
        self.open.append(h)
        return h

    def close(self, h: VllmHarness) -> None:
        self.open.remove(h)
        h.close()


@pytest.fixture
def harnesses() -> Iterator[Harnesses]:
    made = Harnesses()
    try:
        yield made
    finally:
        for h in list(made.open):
            made.close(h)


def assert_locked(root: Path, harness: VllmHarness) -> None:
    """The harness's engine holds its namespace's lock under ``root``."""
    digest = harness.side.geometry.namespace.digest()
    with pytest.raises(ConfigError, match=REFUSED):
        DiskLock.acquire(root, digest).release()


def test_harness_engines_share_a_disk_path_only_across_models(
    harnesses: Harnesses, tiny_model: Path, tiny_swa_model: Path, tmp_path: Path
) -> None:
    chunk = len(LAYERS) * HEADS * 16 * 2 * HEAD_SIZE * 4  # one 16-token block, all layers
    extra = {"disk_path": str(tmp_path), "disk_bytes": 16 * slot_bytes(chunk)}
    first = harnesses.build(tiny_model, extra=extra)
    with pytest.raises(ConfigError, match=REFUSED):
        harnesses.build(tiny_model, extra=extra)
    other = harnesses.build(tiny_swa_model, extra=extra)  # another model: another namespace
    assert_locked(tmp_path, other)
    assert len(list((tmp_path / "kvoffload-v1").iterdir())) == 2
    harnesses.close(first)
    again = harnesses.build(tiny_model, extra=extra)  # released on close
    assert_locked(tmp_path, again)
