"""kvoffload under tensor parallelism (TP=2) in a real vLLM engine, run as a script.

``python -m kvoffload.testing.tensor_parallel --model DIR --disk DIR --out result.json``

vLLM runs tensor parallelism with one worker process per rank (the ``mp`` executor);
on its CPU build the workers are always *spawned*, and spawned workers re-import the
main module, so an engine with TP > 1 can only be built under an ``if __name__ ==
"__main__":`` guard. Tests therefore run this module in a subprocess and read its
JSON output. The CPU build must pin one core per worker
(``VLLM_CPU_OMP_THREADS_BIND="0|1"``; without it vLLM stops with "Not enough allowed
NUMA nodes"); when the variable is unset this module binds the first two cores this
process may run on. The engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set here) while the two workers, each with
kvoffload's worker half, run in their own: kvoffload's scheduler half can then be
drained between prompts (:func:`settle`, as vLLM's engine loop steps an idle engine
with connector work pending, but deterministically) and checked at the end
(:func:`quiescence`). What kvoffload did is read as an operator reads it, from the
engine's metrics (vLLM's ``vllm:*`` series from ``LLM.get_metrics`` and kvoffload's
``kvoffload_*`` series, rebuilt from the connector stats on the same Prometheus
registry), from the disk tier's files after shutdown, and from the workers
themselves (``collective_rpc``; this module allows vLLM's pickle fallback for it).

Every prompt is generated on its own (one prompt per ``generate``, greedy,
``max_tokens`` 8, ``ignore_eos``), in the order of :func:`prompts`: four prompts of
316 to 361 random token ids (vocabulary 1024, fixed seed) sharing their first 256
tokens; none is a whole number of 32-token blocks.

1. ``baseline``: a TP=2 engine without a connector generates every prompt; shut down.
2. ``first``: the same engine with kvoffload (host memory for :data:`HOST_CHUNKS`
   chunks, fewer than the run stores, so it evicts; a disk tier under ``--disk`` for
   :data:`DISK_CHUNKS` chunks, write-through: every stored chunk is also written to
   disk, each rank its share in its own slab file) generates every prompt.
3. ``after_reset``: ``LLM.reset_prefix_cache()`` (the engine forgets its own prefix
   cache; kvoffload is not told) and every prompt again: each full chunk of the
   prompts must now come from kvoffload exactly once (a later prompt finds the chunks
   an earlier one loaded in the engine's cache), from host memory or, for what host
   memory evicted, from disk (a tier load, straight into the engine). The engine is
   shut down, then the disk tier's files are inspected and verified.

The JSON output (one object; every count is an integer):

- ``tensor_parallel_size``: ``{"baseline": n, "kvoffload": n}``, as each engine's
  ``vllm_config.parallel_config`` reports it;
- ``workers``: one entry per worker of the kvoffload engine, from ``collective_rpc``:
  ``{"pid", "tp_rank", "tp_world_size", "kvoffload_worker": bool}`` (the last: the
  worker holds kvoffload's worker half); ``driver_pid``: this process' pid;
- ``engine_blocks``: the KV cache blocks of the kvoffload engine (per worker);
- ``prompts``: the prompts' token ids; ``block_size``: 32 (= kvoffload's chunk size);
- ``outputs``: ``{"baseline" | "first" | "after_reset": [[token id, ...] per prompt]}``;
- ``cached_tokens``: ``{"first" | "after_reset": [num_cached_tokens per prompt]}``
  (vLLM's count of prompt tokens not computed: its own prefix cache plus the
  connector's);
- ``metrics``: ``{"first" | "after_reset": {series: increase during the phase}}``,
  counters and histogram counts and sums, series named ``name{label=value,...}``
  with labels sorted and vLLM's ``engine``/``model_name`` labels left out, zero
  increases left out. Among them: ``vllm:external_prefix_cache_hits`` (prompt tokens
  the connector supplied), ``vllm:prefix_cache_hits`` (the engine's own cache),
  ``kvoffload_hit_tokens_total{tier=host|disk}``,
  ``kvoffload_transferred_chunks_total{direction=load|store|spill|promote,tier=...}``
  and ``kvoffload_transfer_bytes_count{direction=...,tier=...}`` (one observation per
  job *and worker*: twice the jobs with two workers);
- ``settled``: per prompt of ``first`` then ``after_reset``, whether kvoffload's jobs
  drained after it within :data:`SETTLE_TIMEOUT_S` (:func:`settle`);
- ``quiescence``: kvoffload's scheduler half at the end, before shutdown:
  ``{"guard_errors": [...], "anomalies": {kind: n}, "pinned_chunks": n,
  "jobs_in_flight": n, "integrity": "ok" or the violation}``;
- ``disk``: the disk tier after shutdown, as ``kvoffload inspect`` reads it, one
  entry per namespace: ``{"namespace", "world_size", "complete_chunks",
  "incomplete_chunks", "shares_per_rank": {rank: used slots}, "ok", "bad",
  "slab_files": [path relative to --disk, ...]}``.

Exit status 0 when the run completed (whatever the numbers say: the caller judges);
any exception propagates (non-zero status, traceback on stderr).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

BLOCK = 32  # engine block size = kvoffload chunk size (tokens)
VOCAB = 1024
SHARED_TOKENS = 256
SUFFIX_TOKENS = (60, 75, 90, 105)  # no prompt is a whole number of blocks
MAX_TOKENS = 8
TP = 2
CHUNK_BYTES = 32 * 1024  # one chunk, all workers: 2 layers x 2 KV heads x 32 x 2 x 32 x 4
KV_BLOCKS = 128  # engine blocks of KV cache (each worker holds its heads of each)
HOST_CHUNKS = 12  # host memory for 12 chunks, fewer than the run stores: it evicts
DISK_CHUNKS = 64
SETTLE_TIMEOUT_S = 120.0

Metrics = dict[str, float]


def prompts(seed: int = 0) -> list[list[int]]:
    """The prompts: a shared 256-token prefix, then a distinct suffix each."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, VOCAB) for _ in range(SHARED_TOKENS)]
    return [shared + [rng.randrange(3, VOCAB) for _ in range(n)] for n in SUFFIX_TOKENS]


def kvoffload_config(disk: Path) -> dict[str, Any]:
    """``kv_connector_extra_config``: sizes are for all workers together."""
    from kvoffload.tiers.disk import slot_bytes

    per_worker_chunk = CHUNK_BYTES // TP
    return {
        "cpu_bytes": HOST_CHUNKS * CHUNK_BYTES,
        "disk_path": str(disk),
        "disk_bytes": DISK_CHUNKS * TP * slot_bytes(per_worker_chunk),
        # A busy 2-core machine: never let a deferred request give up on a promotion.
        "max_deferral_seconds": 60.0,
    }


@contextmanager
def engine(model: Path, extra: dict[str, Any] | None) -> Iterator[Any]:
    """A TP=2 ``vllm.LLM`` over ``model`` with kvoffload configured by ``extra``
    (None: no connector), stats on; shut down on exit."""
    from kvoffload.testing.vllm_cpu import cpu_llm_args, kvoffload_transfer
    from vllm import LLM

    llm = LLM(
        **cpu_llm_args(str(model), BLOCK, KV_BLOCKS * CHUNK_BYTES // TP),  # per worker
        tensor_parallel_size=TP,
        distributed_executor_backend="mp",
        kv_transfer_config=kvoffload_transfer(extra),
        disable_log_stats=False,
    )
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def generate(llm: Any, prompt: Sequence[int], max_tokens: int = MAX_TOKENS) -> Any:
    """The greedy output of one prompt (``ignore_eos``)."""
    from vllm.inputs import TokensPrompt

    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    inputs = [TokensPrompt(prompt_token_ids=list(prompt))]
    [out] = llm.generate(inputs, params, use_tqdm=False)
    return out


def run_phase(
    llm: Any, ids: Sequence[Sequence[int]], settled: list[bool] | None = None
) -> tuple[list[list[int]], list[int]]:
    """Every prompt on its own: (output token ids, cached prompt tokens) per prompt.
    With ``settled``, kvoffload's jobs are drained after each prompt (:func:`settle`)
    and whether each drain finished in time is appended."""
    outputs, cached = [], []
    for prompt in ids:
        out = generate(llm, prompt)
        outputs.append(list(out.outputs[0].token_ids))
        cached.append(int(out.num_cached_tokens or 0))
        if settled is not None:
            settled.append(settle(llm))
    return outputs, cached


def _series(name: str, labels: dict[str, str]) -> str:
    kept = sorted((k, v) for k, v in labels.items() if k not in ("engine", "model_name"))
    return name + "{" + ",".join(f"{k}={v}" for k, v in kept) + "}"


_KEPT_SAMPLES = {"counter": ("_total",), "histogram": ("_count", "_sum")}


def read_metrics(llm: Any) -> Metrics:
    """The engine's counters and histograms (count and sum) as vLLM's stat loggers
    recorded them, summed over vLLM's per-engine labels."""
    from prometheus_client import REGISTRY
    from vllm.v1.metrics.reader import Counter, Histogram

    out: Metrics = {}

    def add(key: str, value: float) -> None:
        out[key] = out.get(key, 0.0) + value

    for metric in llm.get_metrics():  # vLLM's own series ("vllm:*")
        if isinstance(metric, Counter):
            add(_series(metric.name, metric.labels), metric.value)
        elif isinstance(metric, Histogram):
            add(_series(metric.name + "_count", metric.labels), metric.count)
            add(_series(metric.name + "_sum", metric.labels), metric.sum)
    for family in REGISTRY.collect():  # kvoffload's, rebuilt from the connector stats
        if not family.name.startswith("kvoffload_"):
            continue
        wanted = _KEPT_SAMPLES.get(family.type, ())
        for sample in family.samples:
            if sample.name.endswith(wanted):
                add(_series(sample.name, sample.labels), sample.value)
    return out


def increase(before: Metrics, after: Metrics) -> dict[str, int | float]:
    """What grew between two readings."""
    grown: dict[str, int | float] = {}
    for key, value in sorted(after.items()):
        delta = value - before.get(key, 0.0)
        if delta:
            grown[key] = int(delta) if float(delta).is_integer() else delta
    return grown


def half(llm: Any) -> Any:
    """kvoffload's scheduler half (the engine core runs in this process)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side.scheduler


def settle(llm: Any, timeout_s: float = SETTLE_TIMEOUT_S) -> bool:
    """Step the engine until kvoffload has nothing in flight or queued (stores,
    spills to disk, promotions), as vLLM's engine loop steps an idle engine while
    the connector has pending work; False if that takes over ``timeout_s``."""
    core = llm.llm_engine.engine_core.engine_core
    h = half(llm)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not (core.scheduler.has_requests() or h.jobs_in_flight() or h.tiers.has_queued()):
            return True
        llm.llm_engine.step()  # as the engine loop does (stats go to the stat loggers)
        time.sleep(0.002)
    return False


def quiescence(llm: Any) -> dict[str, Any]:
    """kvoffload's scheduler half at rest: errors caught at the engine boundary,
    anomalies, pins and jobs left, and whether its invariants hold."""
    side = llm.llm_engine.engine_core.engine_core.scheduler.connector.scheduler_side
    h = half(llm)
    integrity = "ok"
    try:
        h.check_integrity()
    except Exception as exc:  # reported, judged by the caller
        integrity = f"{type(exc).__name__}: {exc}"
    return {
        "guard_errors": [str(e) for e in side.guard.errors],
        "anomalies": dict(h.anomalies.counts),
        "pinned_chunks": int(h.directory.pinned_count)
        + sum(int(t.directory.pinned_count) for t in h.tiers.directory_tiers()),
        "jobs_in_flight": len(h.jobs_in_flight()),
        "integrity": integrity,
    }


def _worker_identity(worker: Any) -> dict[str, Any]:
    """Runs in each worker process (``collective_rpc``)."""
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    side = (
        getattr(get_kv_transfer_group(), "worker_side", None) if has_kv_transfer_group() else None
    )
    return {
        "pid": os.getpid(),
        "tp_rank": int(get_tensor_model_parallel_rank()),
        "tp_world_size": int(get_tensor_model_parallel_world_size()),
        "kvoffload_worker": side is not None,
    }


def inspect_disk_tier(root: Path) -> list[dict[str, Any]]:
    """What the disk tier's files hold, namespace by namespace (all slots verified)."""
    from kvoffload.inspection.disk_scan import inspect_disk
    from kvoffload.inspection.model import DiskNamespaceReport

    report = inspect_disk(root, None, verify=True, world_size=None)
    entries = []
    for ns in report.namespaces:
        assert isinstance(ns, DiskNamespaceReport)
        base = root / "kvoffload-v1" / ns.namespace
        entries.append(
            {
                "namespace": ns.namespace,
                "world_size": ns.world_size,
                "complete_chunks": ns.complete_chunks,
                "incomplete_chunks": ns.incomplete_chunks,
                "shares_per_rank": {str(r): n for r, n in sorted(ns.shares_per_rank.items())},
                "ok": ns.ok,
                "bad": ns.bad_total,
                "slab_files": sorted(str(p.relative_to(root)) for p in base.glob("slab.r*")),
            }
        )
    return entries


def run(model: Path, disk: Path) -> dict[str, Any]:
    ids = prompts()
    result: dict[str, Any] = {
        "block_size": BLOCK,
        "prompts": ids,
        "driver_pid": os.getpid(),
        "tensor_parallel_size": {},
        "outputs": {},
        "cached_tokens": {},
        "metrics": {},
    }
    with engine(model, None) as llm:
        result["tensor_parallel_size"]["baseline"] = _tp_size(llm)
        result["outputs"]["baseline"], _ = run_phase(llm, ids)
    with engine(model, kvoffload_config(disk)) as llm:
        result["tensor_parallel_size"]["kvoffload"] = _tp_size(llm)
        result["workers"] = llm.collective_rpc(_worker_identity)
        result["engine_blocks"] = int(llm.llm_engine.vllm_config.cache_config.num_gpu_blocks)
        settled: list[bool] = []
        start = read_metrics(llm)
        result["outputs"]["first"], result["cached_tokens"]["first"] = run_phase(llm, ids, settled)
        stored = read_metrics(llm)
        result["metrics"]["first"] = increase(start, stored)
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache")
        again = run_phase(llm, ids, settled)
        result["outputs"]["after_reset"], result["cached_tokens"]["after_reset"] = again
        result["metrics"]["after_reset"] = increase(stored, read_metrics(llm))
        result["settled"] = settled
        result["quiescence"] = quiescence(llm)
    result["disk"] = inspect_disk_tier(disk)
    return result


def _tp_size(llm: Any) -> int:
    return int(llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size)


def default_binding() -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for TP workers: one core each, the first cores
    this process may run on (``"0|1"`` on a machine with cores 0 and 1)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < TP:
        raise SystemExit(f"tensor parallelism {TP} needs {TP} cores; allowed: {cores}")
    return "|".join(str(c) for c in cores[:TP])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvoffload.testing.tensor_parallel",
        description="Run kvoffload in a TP=2 vLLM engine and write what happened as JSON.",
    )
    parser.add_argument("--model", type=Path, required=True, help="model directory")
    parser.add_argument("--disk", type=Path, required=True, help="disk tier directory")
    parser.add_argument("--out", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", default_binding())
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(fn)
    result = run(args.model, args.disk)
    args.out.write_text(json.dumps(result, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
