"""The deployment shapes kvoffload serves, checked once at start.

Served: one engine or several (data-parallel replicas), tensor parallelism, alone or
as one child of vLLM's ``MultiConnector`` (beside a P/D connector), with
``kv_role: kv_both``. Refused at start, in one line naming the field and the reason:

- **pipeline parallelism** (``pipeline_parallel_size > 1``): each stage holds other
  layers, with a KV layout of its own, while the scheduler half looks chunks up
  under one layout; a stage's disk and Redis copies would never be found, and vLLM's
  speculative path returns from non-last stages before their stores are submitted;
- **decode or prefill context parallelism** (``decode_context_parallel_size`` or
  ``prefill_context_parallel_size > 1``): each rank holds a slice of every block's
  tokens, which kvoffload's chunks (whole blocks per rank) do not describe;
- **a one-way ``kv_role``** (``kv_producer``, ``kv_consumer``): kvoffload both
  stores and loads; a one-way cache is not offered.

:func:`deployment_problem` is pure (the vLLM plugin calls it on the engine
arguments, before the model loads); :func:`check_deployment` reads a built
``VllmConfig``. Both raise nothing but :class:`ConfigError`.
"""

from __future__ import annotations

from typing import Any

from kvoffload.core.errors import ConfigError

SERVE_WITHOUT = "serve this engine without kvoffload"


def deployment_problem(
    *,
    pipeline_parallel_size: int = 1,
    decode_context_parallel_size: int = 1,
    prefill_context_parallel_size: int = 1,
    kv_role: str | None = "kv_both",
) -> ConfigError | None:
    """The first reason the deployment cannot be served, or None."""
    if pipeline_parallel_size > 1:
        return ConfigError(
            "pipeline_parallel_size",
            f"{pipeline_parallel_size}: kvoffload does not serve pipeline parallelism "
            "(each stage holds other layers under a layout of its own); use "
            f"pipeline_parallel_size=1 or {SERVE_WITHOUT}",
        )
    for name, size in (
        ("decode_context_parallel_size", decode_context_parallel_size),
        ("prefill_context_parallel_size", prefill_context_parallel_size),
    ):
        if size > 1:
            return ConfigError(
                name,
                f"{size}: kvoffload does not serve context parallelism (each rank holds "
                f"a slice of every block's tokens); use {name}=1 or {SERVE_WITHOUT}",
            )
    if kv_role is not None and kv_role != "kv_both":
        return ConfigError(
            "kv_role",
            f'{kv_role!r}: kvoffload stores and loads; give it "kv_role": "kv_both"',
        )
    return None


def check_deployment(vllm_config: Any, transfer: Any) -> None:
    """Raise the :class:`ConfigError` of :func:`deployment_problem` for a built
    ``VllmConfig`` and kvoffload's ``kv_transfer_config``."""
    parallel = vllm_config.parallel_config
    problem = deployment_problem(
        pipeline_parallel_size=int(getattr(parallel, "pipeline_parallel_size", 1)),
        decode_context_parallel_size=int(getattr(parallel, "decode_context_parallel_size", 1)),
        prefill_context_parallel_size=int(getattr(parallel, "prefill_context_parallel_size", 1)),
        kv_role=getattr(transfer, "kv_role", "kv_both"),
    )
    if problem is not None:
        raise problem
