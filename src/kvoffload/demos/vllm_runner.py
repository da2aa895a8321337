"""Run token-id workloads through an in-process vLLM engine and measure them.

Importing this module sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (vLLM reads it when
an engine is built, so it must be set before one is): the engine core, the model
and any KV connector then live in this process, start in about two seconds, and
can be inspected directly.

Workloads are *batches* of requests: every request of a batch is submitted at
once (one ``LLM.generate`` call) and the next batch starts when all of them have
finished. For the multi-turn chat workload a batch is one turn of every user, since
turn ``t + 1`` of a user extends turn ``t``'s prompt (``turn_batches``).

Time to first token (TTFT) is vLLM's own per-request ``first_token_latency`` from
``RequestOutput.metrics`` (the engine is built with ``disable_log_stats=False``;
offline ``LLM`` disables stats by default, leaving ``metrics`` empty). It spans
from the request's arrival (when ``generate`` added it) to the processing of the
engine step that produced its first token, so it includes queueing behind the
other requests of the same batch, prefill, KV loads and the first sampling step,
exactly what a user who sent the message with everyone else would wait. This is
exact per request, unlike timing a ``max_tokens=1`` pre-pass, which would also
change the workload (an extra prefill that warms the prefix cache).
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from kvoffload.workload.chat import ChatRequest

if TYPE_CHECKING:
    from vllm.entrypoints.llm import LLM

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

ModelDType = Literal["auto", "half", "float16", "bfloat16", "float", "float32"]


class PromptLike(Protocol):
    """A request to run: prompt token ids and how many tokens to generate."""

    @property
    def prompt(self) -> tuple[int, ...]: ...

    @property
    def output_tokens(self) -> int: ...


@dataclass(frozen=True)
class EngineSpec:
    """How to build the ``vllm.LLM``. ``kv_transfer_config`` None = no connector."""

    model: Path
    kv_cache_memory_bytes: int
    block_size: int = 32  # the CPU attention backend needs a multiple of 32
    enforce_eager: bool = True
    dtype: ModelDType = "float32"  # float32: outputs independent of batch composition
    max_model_len: int = 4096
    max_num_seqs: int = 8
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    async_scheduling: bool = False
    torch_threads: int | None = 1  # None: leave torch's intra-op thread count alone
    # None: vLLM decides (its hybrid KV cache manager stays on where supported);
    # True forces one KV cache group for every layer.
    disable_hybrid_kv_cache_manager: bool | None = None
    kv_transfer_config: Mapping[str, Any] | None = field(default=None, hash=False)
    seed: int = 0


@dataclass(frozen=True)
class RequestResult:
    """One finished request. ``batch``/``index``: its position in the workload."""

    batch: int
    index: int
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    cached_tokens: int  # engine prefix cache + connector hits, as vLLM reports them
    preemptions: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class RunResult:
    """Every request's result (in submission order) and the summed ``generate`` time.

    ``local_hit_tokens`` / ``external_hit_tokens``: prompt tokens served by the
    engine's own prefix cache / by the KV connector (vLLM's ``prefix_cache_hits``
    and ``external_prefix_cache_hits`` counters over the run; a preempted request
    that is looked up again counts again).
    """

    requests: tuple[RequestResult, ...]
    wall_s: float
    local_hit_tokens: int = 0
    external_hit_tokens: int = 0

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_tokens for r in self.requests)

    @property
    def generated_tokens(self) -> int:
        return sum(r.output_tokens for r in self.requests)

    @property
    def cached_tokens(self) -> int:
        return sum(r.cached_tokens for r in self.requests)

    @property
    def ttfts(self) -> list[float]:
        return [r.ttft_s for r in self.requests]

    @property
    def mean_ttft_s(self) -> float:
        return sum(self.ttfts) / max(1, len(self.requests))

    def ttft_percentile(self, q: float) -> float:
        """TTFT at quantile ``q`` in [0, 1], linearly interpolated."""
        return percentile(self.ttfts, q)

    @property
    def generated_tok_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def prompt_tok_s(self) -> float:
        """Prompt tokens served per second, cached ones included."""
        return self.prompt_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def mean_ttft_per_batch(self) -> list[float]:
        by_batch: dict[int, list[float]] = {}
        for r in self.requests:
            by_batch.setdefault(r.batch, []).append(r.ttft_s)
        return [sum(v) / len(v) for _, v in sorted(by_batch.items())]


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated quantile ``q`` in [0, 1] of ``values`` (0.0 when empty)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def turn_batches(requests: Sequence[ChatRequest]) -> list[list[ChatRequest]]:
    """Group chat requests by turn (every user's turn ``t`` is one batch), in turn order."""
    turns: dict[int, list[ChatRequest]] = {}
    for r in requests:
        turns.setdefault(r.turn, []).append(r)
    return [turns[t] for t in sorted(turns)]


@contextmanager
def open_engine(spec: EngineSpec) -> Iterator[LLM]:
    """Build an in-process ``vllm.LLM`` for ``spec``; shut it down and free it on exit.

    The engine owns its KV cache and connector; on exit the engine core is shut
    down (which shuts the worker-side connector down), the process-wide connector
    slot and distributed state are cleared, and memory is collected, so another
    engine (with another connector) can be built next in the same process.
    """
    try:
        llm = _build(spec)
    except BaseException:
        _reset_process_state()  # a half-built engine may have set process-wide state
        raise
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        _reset_process_state()


def _build(spec: EngineSpec) -> LLM:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm.entrypoints.llm import LLM

    if spec.torch_threads is not None:
        # In-process, vLLM's CPU worker replaces torch.set_num_threads with a no-op
        # before it can reduce torch to one thread, so the model would run with one
        # spin-waiting OpenMP thread per core: on a shared machine that is up to 10x
        # slower whenever another process holds a core. torch._C keeps the original.
        torch._C.set_num_threads(spec.torch_threads)

    kwargs: dict[str, Any] = {}
    if spec.kv_transfer_config is not None:
        kwargs["kv_transfer_config"] = dict(spec.kv_transfer_config)
    if spec.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = spec.max_num_batched_tokens
    if spec.disable_hybrid_kv_cache_manager is not None:
        kwargs["disable_hybrid_kv_cache_manager"] = spec.disable_hybrid_kv_cache_manager
    return LLM(
        model=str(spec.model),
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=spec.kv_cache_memory_bytes,
        block_size=spec.block_size,
        enforce_eager=spec.enforce_eager,
        dtype=spec.dtype,
        max_model_len=spec.max_model_len,
        max_num_seqs=spec.max_num_seqs,
        enable_prefix_caching=spec.enable_prefix_caching,
        async_scheduling=spec.async_scheduling,
        seed=spec.seed,
        disable_log_stats=False,  # fills RequestOutput.metrics (TTFT)
        use_tqdm_on_load=False,
        **kwargs,
    )


def _reset_process_state() -> None:
    """Clear the process-wide connector slot and distributed state; collect memory."""
    from vllm.distributed.kv_transfer import ensure_kv_transfer_shutdown
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    ensure_kv_transfer_shutdown()
    cleanup_dist_env_and_memory()
    gc.collect()


def run_batches(
    llm: LLM,
    batches: Sequence[Sequence[PromptLike]],
    on_batch: Callable[[int, Sequence[RequestResult]], None] | None = None,
) -> RunResult:
    """Run ``batches`` in order, each submitted at once; greedy decoding, EOS ignored.

    ``on_batch(batch_index, results)`` is called after each batch (progress bars).
    Raises ``RuntimeError`` if vLLM returns no per-request metrics.
    """
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import SamplingParams

    results: list[RequestResult] = []
    wall = 0.0
    hits_before = _hit_counters(llm)
    for b, batch in enumerate(batches):
        # vLLM's TypedDict uses typing.NotRequired, which mypy targeting 3.10 reads as required.
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt)) for r in batch]
        params = [
            SamplingParams(temperature=0.0, max_tokens=r.output_tokens, ignore_eos=True)
            for r in batch
        ]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall += time.perf_counter() - start
        done = []
        for i, (request, out) in enumerate(zip(batch, outputs, strict=True)):
            if out.metrics is None:
                raise RuntimeError("vLLM returned no request metrics (disable_log_stats?)")
            tokens = tuple(out.outputs[0].token_ids)
            done.append(
                RequestResult(
                    batch=b,
                    index=i,
                    prompt_tokens=len(request.prompt),
                    output_tokens=len(tokens),
                    ttft_s=out.metrics.first_token_latency,
                    cached_tokens=out.num_cached_tokens or 0,
                    preemptions=out.metrics.num_preemptions,
                    token_ids=tokens,
                )
            )
        results += done
        if on_batch is not None:
            on_batch(b, done)
    local, external = _hit_counters(llm)
    local, external = local - hits_before[0], external - hits_before[1]
    return RunResult(tuple(results), wall, local, external)


def _hit_counters(llm: LLM) -> tuple[int, int]:
    """The engine's (prefix-cache hit, connector hit) token counters so far."""
    from vllm.v1.metrics.reader import Counter

    totals = {"vllm:prefix_cache_hits": 0, "vllm:external_prefix_cache_hits": 0}
    for metric in llm.get_metrics():
        if isinstance(metric, Counter) and metric.name in totals:
            totals[metric.name] += metric.value
    return totals["vllm:prefix_cache_hits"], totals["vllm:external_prefix_cache_hits"]


@dataclass(frozen=True)
class _Warmup:
    prompt: tuple[int, ...]
    output_tokens: int


def warm_up(llm: LLM, first_token: int = 3, tokens: int = 256) -> None:
    """Two requests, so one-time start-up costs (kernel set-up) stay out of measurements.

    Their prompts (``first_token`` repeated) are unlike any random workload prompt;
    they leave ``tokens // block_size`` blocks in the prefix cache and in an offload
    tier, which the workload evicts like any other unused blocks.
    """
    run_batches(llm, [[_Warmup((first_token,) * tokens, 4), _Warmup((first_token,) * 33, 2)]])


def run(
    spec: EngineSpec,
    batches: Sequence[Sequence[PromptLike]],
    on_batch: Callable[[int, Sequence[RequestResult]], None] | None = None,
    warmup: bool = True,
) -> RunResult:
    """Build an engine for ``spec``, optionally warm it up, run ``batches``, free it."""
    with open_engine(spec) as llm:
        if warmup:
            warm_up(llm)
        return run_batches(llm, batches, on_batch)
