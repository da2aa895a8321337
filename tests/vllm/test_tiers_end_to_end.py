"""Disk and Redis tiers inside a real in-process vLLM engine (float32, tiny Llama).

Every scenario checks the three things that matter after a fault: outputs equal to
an engine without offloading, no pin left behind, and counters that say what
happened.
"""

from __future__ import annotations

import errno
import gc
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from redis_server import RedisServer

BLOCK = 32
CHUNK_BYTES = 32 * 1024  # 2 layers x 2 KV heads x 32 tokens x 2 x 32 dims x 4 bytes
PROMPTS = [[(7 * p + 3 * i) % 997 + 3 for i in range(8 * BLOCK)] for p in range(4)]


@contextmanager
def engine(model: Path, extra: dict[str, Any] | None, dtype: str = "float32") -> Iterator[Any]:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from vllm import LLM

    transfer = None
    if extra is not None:
        transfer = {
            "kv_connector": "KVOffloadConnector",
            "kv_connector_module_path": "kvoffload.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
    llm = LLM(
        model=str(model),
        skip_tokenizer_init=True,
        max_model_len=1024,
        block_size=BLOCK,
        enforce_eager=True,
        dtype=dtype,
        kv_cache_memory_bytes=128 * 32 * 1024,
        enable_prefix_caching=True,
        max_num_seqs=4,
        seed=0,
        kv_transfer_config=transfer,
    )
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        cleanup_dist_env_and_memory()
        gc.collect()


def generate(llm: Any, prompts: list[list[int]], salt: str | None = None) -> list[Any]:
    from vllm.inputs import TokensPrompt

    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    inputs = [
        TokensPrompt(prompt_token_ids=p, **({"cache_salt": salt} if salt else {}))  # type: ignore[typeddict-item]
        for p in prompts
    ]
    return list(llm.generate(inputs, params, use_tqdm=False))


def tokens(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def half(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side.scheduler


def tier(llm: Any, name: str) -> Any:
    return half(llm).tiers.tiers[name]


def settle(llm: Any) -> None:
    """Step the engine until kvoffload has nothing in flight. Each step first waits
    for the worker's copies and tier jobs to finish (so the step's report delivers
    them: completion is driven by the test, not by timing); vLLM keeps stepping an
    idle engine while the connector has pending work."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    core = llm.llm_engine.engine_core.engine_core
    worker = get_kv_transfer_group().worker_side
    for _ in range(50):
        if not core.scheduler.has_requests():
            return
        if worker.tiers is not None:
            assert worker.tiers.wait(worker.tiers.running(), timeout=60)
        worker.worker.wait(worker.worker.running())
        core.step()
    h = half(llm)
    raise AssertionError(
        f"kvoffload jobs did not drain: in flight {h.jobs_in_flight()}, "
        f"queued below host {h.tiers.has_queued()}, promotions {h._promotions}"
    )


def quiescent(llm: Any) -> None:
    h = half(llm)
    assert h.directory.pinned_count == 0 and h.jobs_in_flight() == []
    for t in h.tiers.directory_tiers():
        assert t.directory.pinned_count == 0
    h.check_integrity()


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


def test_the_disk_tier_serves_what_host_memory_evicted(
    tiny_model: Path, tmp_path: Path, reference: dict[int, list[int]]
) -> None:
    with engine(tiny_model, config(tmp_path)) as llm:
        push_below_host(llm)
        again = generate(llm, [PROMPTS[0]])[0]
        assert again.num_cached_tokens == len(PROMPTS[0])
        assert list(again.outputs[0].token_ids) == reference[0]
        assert tier(llm, "disk").stats.promoted_chunks >= 8
        settle(llm)
        quiescent(llm)


def test_the_disk_tier_survives_a_restart(
    tiny_model: Path, tmp_path: Path, reference: dict[int, list[int]]
) -> None:
    with engine(tiny_model, config(tmp_path)) as llm:
        generate(llm, [PROMPTS[0]])
        settle(llm)
        assert tier(llm, "disk").stats.spilled_chunks == 8
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
        assert tier(llm, "redis").stats.spilled_chunks == 8
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
        assert tier(llm, "disk").stats.spilled_chunks == 8
        llm.reset_prefix_cache(reset_connector=True)  # host memory forgets: only lower tiers
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
    with engine(tiny_model, config(redis=server)) as llm:
        assert tokens(generate(llm, [PROMPTS[0]])) == [reference[0]]
        settle(llm)
        redis = tier(llm, "redis")
        assert redis.stats.spill_failures >= 8 or redis.query_errors >= 1
        server.start()
        redis.retry_now()  # do not wait out the back-off in a test
        assert tokens(generate(llm, [PROMPTS[1]])) == [reference[1]]
        settle(llm)
        assert redis.stats.spilled_chunks >= 8
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

    def full(fd: int, buffers: object) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(disk_module.os, "writev", full)
    with engine(tiny_model, config(tmp_path)) as llm:
        push_below_host(llm)
        assert tier(llm, "disk").stats.spill_failures >= 8
        assert tokens(generate(llm, [PROMPTS[0]])) == [reference[0]]
        settle(llm)
        quiescent(llm)


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_chunk_file_is_a_counted_miss_and_is_deleted(
    tiny_model: Path, tmp_path: Path, reference: dict[int, list[int]], damage: str
) -> None:
    with engine(tiny_model, config(tmp_path)) as llm:
        push_below_host(llm)
        files = sorted((tmp_path / "disk").rglob("*.r0"))
        assert len(files) >= 8
        damaged = {}
        for path in files:
            raw = path.read_bytes()
            damaged[path] = (
                raw[:-7] if damage == "truncate" else raw[:100] + bytes([raw[100] ^ 1]) + raw[101:]
            )
            path.write_bytes(damaged[path])
        again = generate(llm, [PROMPTS[0]])[0]
        assert list(again.outputs[0].token_ids) == reference[0]
        settle(llm)
        stats = tier(llm, "disk").stats
        assert sum(stats.integrity_errors.values()) >= 1
        # Every bad copy read was deleted; the recomputed chunks were written again.
        read = [p for p in files if not p.exists() or p.read_bytes() != damaged[p]]
        assert len(read) >= sum(stats.integrity_errors.values())
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
        assert sum(tier(llm, "redis").stats.integrity_errors.values()) >= 1
        quiescent(llm)
