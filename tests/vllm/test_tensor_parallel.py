"""kvoffload in a real vLLM engine with tensor parallelism 2 (two worker processes).

An engine with TP > 1 spawns its workers, which needs a ``__main__`` guard: the run is
``python -m kvoffload.testing.tensor_parallel`` in a subprocess (its docstring
describes the run and its JSON output), started once for the module; the tests
judge what it wrote. Expected numbers are derived from the prompts and the 32-token
chunk size, not read back from kvoffload.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvoffload.testing.tensor_parallel import CHUNK_BYTES, MAX_TOKENS, TP, default_binding

pytestmark = pytest.mark.slow

TIMEOUT_S = 900  # about 2 minutes on an idle 2-core machine; far more when it is busy


def chunk_prefixes(sequences: list[list[int]], size: int) -> set[tuple[int, ...]]:
    """The distinct full chunks of ``sequences``, each named by the tokens up to its end
    (a chunk's key is its whole prefix)."""
    return {tuple(s[:end]) for s in sequences for end in range(size, len(s) + 1, size)}


@pytest.fixture(scope="module")
def run(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    if len(os.sched_getaffinity(0)) < TP:
        pytest.skip(f"tensor parallelism {TP} needs {TP} cores")
    work = tmp_path_factory.mktemp("tp")
    out = work / "result.json"
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": default_binding()}  # "0|1" here
    command = [
        sys.executable,
        "-m",
        "kvoffload.testing.tensor_parallel",
        *("--model", str(tiny_model), "--disk", str(work / "disk"), "--out", str(out)),
    ]
    done = subprocess.run(
        command, check=False, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    assert done.returncode == 0, f"exit {done.returncode}:\n{done.stderr[-6000:]}"
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def test_the_engine_really_ran_two_tensor_parallel_workers(run: dict[str, Any]) -> None:
    assert run["tensor_parallel_size"] == {"baseline": 2, "kvoffload": 2}
    workers = run["workers"]
    assert sorted(w["tp_rank"] for w in workers) == [0, 1]
    assert all(w["tp_world_size"] == 2 and w["kvoffload_worker"] for w in workers)
    pids = {w["pid"] for w in workers}
    assert len(pids) == 2 and run["driver_pid"] not in pids  # two processes, not this one


def test_outputs_with_kvoffload_equal_outputs_without(run: dict[str, Any]) -> None:
    baseline = run["outputs"]["baseline"]
    assert [len(t) for t in baseline] == [MAX_TOKENS] * len(run["prompts"])
    assert run["outputs"]["first"] == baseline
    assert run["outputs"]["after_reset"] == baseline  # prefixes loaded from kvoffload


def test_after_the_reset_kvoffload_serves_every_prompt_chunk_once(run: dict[str, Any]) -> None:
    prompts, block = run["prompts"], run["block_size"]
    chunks = chunk_prefixes(prompts, block)
    assert len(chunks) == 16  # the shared prefix (8) and 1, 2, 2 and 3 more
    first, after = run["metrics"]["first"], run["metrics"]["after_reset"]
    assert "vllm:external_prefix_cache_hits{}" not in first  # nothing to load yet
    # Every full prompt chunk counts as cached: the engine's own cache was reset, so
    # a chunk comes from kvoffload the first time a prompt needs it, and from the
    # engine's cache (where that load put it) for the later prompts sharing it.
    assert run["cached_tokens"]["after_reset"] == [len(p) // block * block for p in prompts]
    assert after["vllm:external_prefix_cache_hits{}"] == len(chunks) * block == 512
    assert after["vllm:prompt_tokens_by_source{source=external_kv_transfer}"] == 512
    # Host memory (12 chunks) had evicted some: those were read from disk straight into
    # the engine (tier loads); every load is observed under the tier it read from.
    tier_loaded = after.get("kvoffload_transferred_chunks_total{direction=load,tier=disk}", 0)
    assert 0 < tier_loaded < len(chunks)
    host_loaded = after["kvoffload_transferred_chunks_total{direction=load,tier=host}"]
    assert host_loaded + tier_loaded == len(chunks)
    assert after["kvoffload_hit_tokens_total{tier=host}"] == 512 - tier_loaded * block
    # One load job per prompt, observed once per worker: both ranks loaded their share.
    count = {
        t: after.get(f"kvoffload_transfer_bytes_count{{direction=load,tier={t}}}", 0)
        for t in ("host", "disk")
    }
    assert count["host"] + count["disk"] == TP * len(prompts)
    moved = sum(
        after.get(f"kvoffload_transfer_bytes_sum{{direction=load,tier={t}}}", 0)
        for t in ("host", "disk")
    )
    assert moved == len(chunks) * CHUNK_BYTES  # each worker moved its half of every chunk
    for t in ("host", "disk"):
        assert after.get(f"kvoffload_failed_chunks_total{{direction=load,tier={t}}}", 0) == 0
    disk_hits = after.get("kvoffload_hit_tokens_total{tier=disk}", 0)
    assert disk_hits > 0 and disk_hits % block == 0


def test_both_ranks_stored_their_share_of_every_chunk_on_disk(run: dict[str, Any]) -> None:
    block = run["block_size"]
    # What the first pass computed: each prompt and all but its last output token.
    computed = [p + t[:-1] for p, t in zip(run["prompts"], run["outputs"]["first"], strict=True)]
    stored = len(chunk_prefixes(computed, block))
    assert stored == 18  # the 16 prompt chunks and 2 filled while decoding
    first = run["metrics"]["first"]
    assert first["kvoffload_transferred_chunks_total{direction=store,tier=host}"] == stored
    assert first["kvoffload_transferred_chunks_total{direction=spill,tier=disk}"] == stored
    [disk] = run["disk"]  # one namespace: this model, layout, dtype and tp2
    ns = disk["namespace"]
    assert disk["slab_files"] == [f"kvoffload-v1/{ns}/slab.r0", f"kvoffload-v1/{ns}/slab.r1"]
    assert disk["world_size"] == 2
    assert disk["shares_per_rank"] == {"0": stored, "1": stored}
    assert disk["complete_chunks"] == stored and disk["incomplete_chunks"] == 0
    assert disk["ok"] == 2 * stored and disk["bad"] == 0  # every share verified


def test_kvoffload_drained_and_left_nothing_behind(run: dict[str, Any]) -> None:
    assert run["settled"] == [True] * 2 * len(run["prompts"])
    assert run["quiescence"] == {
        "guard_errors": [],
        "anomalies": {},
        "pinned_chunks": 0,
        "jobs_in_flight": 0,
        "integrity": "ok",
    }
    assert run["engine_blocks"] == 128
