"""vLLM's own OffloadingConnector runs on CPU with the bench's baseline spec.

A repeated prompt, after the engine's prefix cache is reset, is served from the
offloaded copy (``num_cached_tokens`` > 0, blocks loaded by our worker) and gives
the same float32 tokens as the first, computed run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvoffload.demos.vllm_runner import EngineSpec, open_engine, run_batches
from kvoffload.workload.chat import ChatRequest

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.mark.slow
def test_repeated_prompt_is_loaded_from_offload(tiny_model: Path) -> None:
    sys.path.insert(0, str(BENCH))
    try:
        from vllm_cpu_offload_spec import CPUCopyWorker, spec_config
    finally:
        sys.path.remove(str(BENCH))
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    spec = EngineSpec(
        model=tiny_model,
        kv_cache_memory_bytes=8 << 20,
        max_model_len=1024,
        max_num_seqs=4,
        kv_transfer_config=spec_config(16 << 20),
    )
    prompt = tuple((i * 37) % 1000 + 3 for i in range(300))  # 9 full blocks of 32
    request = ChatRequest(user=0, turn=0, prompt=prompt, output_tokens=16)
    with open_engine(spec) as llm:
        first = run_batches(llm, [[request]]).requests[0]
        run_batches(llm, [[ChatRequest(0, 0, (5,) * 40, 2)]])  # lets the deferred store run
        assert llm.reset_prefix_cache()
        again = run_batches(llm, [[request]]).requests[0]
        worker = get_kv_transfer_group().connector_worker.worker  # type: ignore[attr-defined]
        assert isinstance(worker, CPUCopyWorker)
        loaded, stored = worker.blocks_loaded, worker.blocks_stored

    assert first.cached_tokens == 0
    assert again.cached_tokens == 288
    assert stored >= 9
    assert loaded == 9
    assert again.token_ids == first.token_ids
