"""Disk and Redis tiers inside a real in-process vLLM engine (float32, tiny Llama).

Every scenario checks the three things that matter after a fault: outputs equal to
an engine without offloading, no pin left behind, and counters that say what
happened.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llm_support import (
    CHUNK_BYTES,
    PROMPTS,
    counted,
    engine,
    generate,
    half,
    quiescent,
    settle,
    tier,
    tokens,
)

from kvoffload.testing.redis_server import RedisServer


def config(
    tmp_path: Path | None = None, redis: RedisServer | None = None, **more: Any
) -> dict[str, Any]:
    extra: dict[str, Any] = {"cpu_bytes": 8 * CHUNK_BYTES, **more}  # host: 8 chunks
    if tmp_path is not None:
        extra.update(disk_path=str(tmp_path / "disk"), disk_bytes=256 * (CHUNK_BYTES + 64))
    if redis is not None:
        extra.update(redis_url=redis.url, redis_timeout_ms=300)
    return extra


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> dict[int, list[int]]:
    with engine(tiny_model, None) as llm:
        return {i: t for i, t in enumerate(tokens(generate(llm, PROMPTS)))}


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path).start()
    try:
        yield server
    finally:
        server.kill()


def push_below_host(llm: Any) -> None:
    """Fill host memory with other prompts so prompt 0's chunks live only below it."""
    generate(llm, [PROMPTS[0]])
    settle(llm)
    for p in PROMPTS[1:]:
        generate(llm, [p])
        settle(llm)
    llm.reset_prefix_cache()


@pytest.mark.parametrize(("loads", "direction"), [("direct", "load"), ("promote", "promote")])
def test_the_disk_tier_serves_what_host_memory_evicted(
    tiny_model: Path, tmp_path: Path, reference: dict[int, list[int]], loads: str, direction: str
) -> None:
    """Straight into the engine's blocks (a tier load: no deferral, no host room) or
    promoted into host memory first; write-through lost no chunk on the way down."""
    with engine(tiny_model, config(tmp_path, lower_tier_loads=loads)) as llm:
        push_below_host(llm)
        again = generate(llm, [PROMPTS[0]])[0]
        assert again.num_cached_tokens == len(PROMPTS[0])
        assert list(again.outputs[0].token_ids) == reference[0]
        assert counted(llm, "transferred_chunks_total", direction=direction, tier="disk") >= 8
        assert counted(llm, "evictions_total", tier="host") > 0
        assert counted(llm, "evicted_without_copy_total", tier="host") == 0
        if loads == "direct":  # offered at once: no request waited
            assert not any(half(llm).metrics.breakdown("deferrals_total", "reason").values())
        settle(llm)
        quiescent(llm)


def test_the_disk_tier_survives_a_restart(
    tiny_model: Path, tmp_path: Path, reference: dict[int, list[int]]
) -> None:
    with engine(tiny_model, config(tmp_path)) as llm:
        generate(llm, [PROMPTS[0]])
        settle(llm)
        assert counted(llm, "transferred_chunks_total", direction="spill", tier="disk") == 8
    with engine(tiny_model, config(tmp_path)) as llm:
        assert tier(llm, "disk").held_count() == 8
        again = generate(llm, [PROMPTS[0]])[0]
        assert again.num_cached_tokens == len(PROMPTS[0])
        assert list(again.outputs[0].token_ids) == reference[0]


def test_a_second_engine_hits_what_the_first_stored_in_redis(
    tiny_model: Path, redis_server: RedisServer, reference: dict[int, list[int]]
) -> None:
    with engine(tiny_model, config(redis=redis_server)) as llm:
        generate(llm, [PROMPTS[1]])
        settle(llm)
        assert counted(llm, "transferred_chunks_total", direction="spill", tier="redis") == 8
    with engine(tiny_model, config(redis=redis_server)) as llm:
        again = generate(llm, [PROMPTS[1]])[0]
        assert again.num_cached_tokens == len(PROMPTS[1])
        assert list(again.outputs[0].token_ids) == reference[1]
        settle(llm)
        quiescent(llm)


def test_no_hits_across_salts_or_namespaces_on_any_tier(
    tiny_model: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    both = config(tmp_path, redis_server)
    with engine(tiny_model, both) as llm:
        generate(llm, [PROMPTS[2]], salt="tenant-a")
        settle(llm)
        assert counted(llm, "transferred_chunks_total", direction="spill", tier="disk") == 8
        for p in PROMPTS[:2]:  # evict tenant-a's chunks from host memory (8 chunks)
            generate(llm, [p])
            settle(llm)
        llm.reset_prefix_cache()  # the engine's own cache forgets: only lower tiers hold it
        other = generate(llm, [PROMPTS[2]], salt="tenant-b")[0]
        assert other.num_cached_tokens == 0
        same = generate(llm, [PROMPTS[2]], salt="tenant-a")[0]
        assert same.num_cached_tokens == len(PROMPTS[2])
    with engine(tiny_model, both, dtype="bfloat16") as llm:  # another namespace
        assert tier(llm, "disk").held_count() == 0
        assert generate(llm, [PROMPTS[2]], salt="tenant-a")[0].num_cached_tokens == 0


def test_redis_down_at_start_killed_restarted_and_slow(
    tiny_model: Path, tmp_path: Path, reference: dict[int, list[int]]
) -> None:
    server = RedisServer(tmp_path)  # not started: down at engine start
    with server, engine(tiny_model, config(redis=server)) as llm:  # killed at the end
        assert tokens(generate(llm, [PROMPTS[0]])) == [reference[0]]
        settle(llm)
        redis = tier(llm, "redis")
        assert (
            redis.metrics.value("failed_chunks_total", direction="spill") >= 8
            or redis.query_errors >= 1
        )
        server.start()
        redis.retry_now()  # do not wait out the back-off in a test
        assert tokens(generate(llm, [PROMPTS[1]])) == [reference[1]]
        settle(llm)
        assert redis.metrics.value("transferred_chunks_total", direction="spill") >= 8
        server.kill()  # killed mid-run
        llm.reset_prefix_cache(reset_connector=True)
        assert tokens(generate(llm, PROMPTS[:2])) == [reference[0], reference[1]]
        settle(llm)
        server.restart()
        redis.retry_now()
        sleeper = server.client()
        import threading

        slow = threading.Thread(target=lambda: sleeper.execute_command("DEBUG", "SLEEP", 1))
        slow.start()
        assert tokens(generate(llm, [PROMPTS[3]])) == [reference[3]]  # slow: timeouts
        slow.join()
        settle(llm)
        quiescent(llm)


def test_a_full_disk_is_a_counted_miss(
    tiny_model: Path,
    tmp_path: Path,
    reference: dict[int, list[int]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kvoffload.tiers import disk as disk_module

    def full(*args: object) -> int:  # a thin-provisioned or shared disk filling up
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(disk_module.os, "pwritev", full)
    with engine(tiny_model, config(tmp_path)) as llm:
        push_below_host(llm)
        assert counted(llm, "failed_chunks_total", direction="spill", tier="disk") >= 8
        assert tokens(generate(llm, [PROMPTS[0]])) == [reference[0]]
        settle(llm)
        quiescent(llm)


@pytest.mark.parametrize("damage", ["payload", "header"])
def test_a_damaged_slot_is_a_counted_miss_and_is_cleared(
    tiny_model: Path, tmp_path: Path, reference: dict[int, list[int]], damage: str
) -> None:
    from kvoffload.tiers.disk import PAYLOAD_OFFSET, slot_bytes
    from kvoffload.tiers.slab_format import SUPERBLOCK_BYTES

    with engine(tiny_model, config(tmp_path)) as llm:
        push_below_host(llm)
        disk = tier(llm, "disk").directory
        slots = [disk.slot_of(k) for k in disk.present_keys()]
        assert len(slots) >= 8
        (slab,) = (tmp_path / "disk").rglob("slab.r0")
        where = PAYLOAD_OFFSET + 100 if damage == "payload" else 70  # payload / chunk key
        with open(slab, "r+b") as f:
            for slot in slots:
                assert slot is not None
                offset = SUPERBLOCK_BYTES + slot * slot_bytes(CHUNK_BYTES) + where
                f.seek(offset)
                byte = f.read(1)
                f.seek(offset)
                f.write(bytes([byte[0] ^ 1]))
        again = generate(llm, [PROMPTS[0]])[0]
        assert list(again.outputs[0].token_ids) == reference[0]
        settle(llm)
        errors = tier(llm, "disk").metrics.breakdown("integrity_errors_total", "reason")
        reason = "checksum" if damage == "payload" else "key"
        assert errors.get(reason, 0) >= 1 and set(errors) == {reason}
        quiescent(llm)


def test_a_garbage_redis_value_is_a_counted_miss(
    tiny_model: Path, redis_server: RedisServer, reference: dict[int, list[int]]
) -> None:
    with engine(tiny_model, config(redis=redis_server)) as llm:
        push_below_host(llm)
        raw = redis_server.client()
        for name in raw.keys("kvoffload:v1:*"):
            raw.set(name, b"not a chunk")
        assert tokens(generate(llm, [PROMPTS[0]])) == [reference[0]]
        settle(llm)
        assert (
            sum(tier(llm, "redis").metrics.breakdown("integrity_errors_total", "reason").values())
            >= 1
        )
        quiescent(llm)
