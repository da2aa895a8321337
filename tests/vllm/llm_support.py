"""In-process vLLM engines with kvoffload for the end-to-end tests (tiny Llama,
block size 32, float32 by default), and the steps tests need around them: greedy
generation, draining kvoffload's jobs deterministically, and quiescence checks."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

BLOCK = 32
CHUNK_BYTES = 32 * 1024  # 2 layers x 2 KV heads x 32 tokens x 2 x 32 dims x 4 bytes
PROMPTS = [[(7 * p + 3 * i) % 997 + 3 for i in range(8 * BLOCK)] for p in range(4)]


def disk_config(tmp_path: Path) -> dict[str, Any]:
    """Host memory of 8 chunks above a disk tier of 64, in ``tmp_path/disk``. The tier
    deadline is a minute: these tests count what the disk holds, and a spill that
    outlives the default 5 s on a starved machine is (rightly) reported failed, which
    would leave the count short (a count of 8 for 16 was seen once on a loaded CI
    machine; not reproduced); the deadline's own tests set theirs."""
    return {
        "cpu_bytes": 8 * CHUNK_BYTES,
        "disk_path": str(tmp_path / "disk"),
        "disk_bytes": 64 * (CHUNK_BYTES + 4096),
        "tier_io_timeout_ms": 60_000,
    }


@contextmanager
def engine(
    model: Path,
    extra: dict[str, Any] | None,
    dtype: str = "float32",
    *,
    kv_blocks: int = 128,
    kv_bytes: int | None = None,
    max_num_seqs: int = 4,
    async_scheduling: bool = False,
    transfer: dict[str, Any] | None = None,
    **more: Any,
) -> Iterator[Any]:
    """An LLM with kvoffload configured by ``extra`` (None: no connector) and
    ``kv_blocks`` engine blocks of the tiny Llama's KV cache (or ``kv_bytes``);
    ``more`` goes to ``LLM`` (e.g. ``kv_events_config``, ``disable_log_stats``);
    ``transfer`` replaces the whole ``kv_transfer_config`` (e.g. a MultiConnector's).
    With ``async_scheduling`` the engine really runs vLLM's AsyncScheduler with a
    batch queue of two (the CPU platform would silently run synchronously; asserted
    here, so a test claiming async fails if it is not). Shut down on exit: collected
    later, it would tear down the parallel groups of the next engine built in this
    process."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from kvoffload.testing.vllm_cpu import (
        cpu_llm_args,
        engine_mode,
        keep_async_scheduling,
        kvoffload_transfer,
    )
    from vllm import LLM

    if async_scheduling:
        keep_async_scheduling()

    args = cpu_llm_args(str(model), BLOCK, kv_bytes or kv_blocks * CHUNK_BYTES, dtype)
    llm = LLM(
        **{**args, **more},  # ``more`` may override the shared arguments (max_model_len)
        max_num_seqs=max_num_seqs,
        kv_transfer_config=transfer if transfer is not None else kvoffload_transfer(extra),
        async_scheduling=async_scheduling,
    )
    try:
        mode = engine_mode(llm)
        want = ("AsyncScheduler", 2) if async_scheduling else ("Scheduler", 1)
        assert (mode.scheduler, mode.batch_queue) == want, f"engine runs {mode}, wanted {want}"
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        cleanup_dist_env_and_memory()
        gc.collect()


def generate(
    llm: Any,
    prompts: list[list[int]],
    salt: str | None = None,
    *,
    max_tokens: int = 8,
    logprobs: int | None = None,
) -> list[Any]:
    """Greedy outputs of ``prompts`` (``ignore_eos``), with ``logprobs`` if asked."""
    from vllm.inputs import TokensPrompt

    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs
    )
    inputs = [
        TokensPrompt(prompt_token_ids=p, **({"cache_salt": salt} if salt else {}))  # type: ignore[typeddict-item]
        for p in prompts
    ]
    return list(llm.generate(inputs, params, use_tqdm=False))


def tokens(outputs: list[Any]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def half(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side.scheduler


def halves(llm: Any) -> list[Any]:
    """Every kvoffload scheduler half of the engine (kvoffload alone, or the
    kvoffload children of a MultiConnector in its order)."""
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    kids = getattr(connector, "sub_connectors", [connector])
    return [k.scheduler_side.scheduler for k in kids if getattr(k, "scheduler_side", None)]


def tier(llm: Any, name: str) -> Any:
    return half(llm).tiers.tier(name)


def counted(llm: Any, name: str, **labels: str) -> int:
    """One counter series of the scheduler half's metrics recorder."""
    return int(half(llm).metrics.value(name, **labels))


def settle(llm: Any) -> None:
    """Step the engine until kvoffload has nothing in flight. Each step first waits
    for the worker's copies, tier jobs and tier loads to finish (so the step's report delivers
    them: completion is driven by the test, not by timing); vLLM keeps stepping an
    idle engine while the connector has pending work."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    core = llm.llm_engine.engine_core.engine_core
    group = get_kv_transfer_group()
    kids = getattr(group, "sub_connectors", [group])  # kvoffload alone or in MultiConnector
    workers = [kid.worker_side for kid in kids if getattr(kid, "worker_side", None) is not None]
    for _ in range(50):
        if not core.scheduler.has_requests():
            return
        for worker in workers:
            if worker.tiers is not None:
                assert worker.tiers.wait(worker.tiers.running(), timeout=60)
            if worker.staged is not None:
                assert worker.staged.wait(worker.staged.running(), timeout=60)
            worker.worker.wait(worker.worker.running())
        llm.llm_engine.step()  # as the engine loop does (stats go to the stat loggers)
    h = halves(llm)[-1]
    raise AssertionError(
        f"kvoffload jobs did not drain: in flight {h.jobs_in_flight()}, "
        f"queued below host {h.tiers.has_queued()}, promotions wished {h.loads.wished}"
    )


def quiescent(llm: Any) -> None:
    side = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side
    assert side.guard.errors == [], side.guard.errors[0]
    h = half(llm)
    assert h.anomalies.counts == {}
    assert h.directory.pinned_count == 0 and h.jobs_in_flight() == []
    for t in h.tiers.directory_tiers():
        assert t.directory.pinned_count == 0
    h.check_integrity()
