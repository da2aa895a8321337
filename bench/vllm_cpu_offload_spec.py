"""Baseline: vLLM's native OffloadingConnector, made to run on CPU by an out-of-tree spec.

vLLM 0.32's ``CPUOffloadingSpec`` refuses to build its worker unless the platform is
CUDA-alike or XPU (its worker uses CUDA streams and pinned memory). This module
keeps everything of the native connector that is platform-free (the scheduler
side, ``CPUOffloadingManager`` with its LRU/ARC policy, job plumbing, the one-step
store deferral and flush fences) and supplies only the worker: a synchronous
CPU->CPU copier written here. It is the baseline ``bench/e2e.py`` compares
kvoffload against.

Use it with::

    {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
     "kv_connector_extra_config": {"spec_name": "CPUCopyOffloadingSpec",
                                   "spec_module_path": "vllm_cpu_offload_spec",
                                   "cpu_bytes_to_use": N}}

with ``bench/`` on ``sys.path`` (``spec_config`` builds this dict).

Worker contract: one host buffer per canonical KV tensor, ``num_chunks`` rows of
that tensor's page size; chunk ``c`` of a tensor lives in row ``c``. A transfer is
one batched ``index_select`` + ``index_copy_`` per tensor on int64 views (8-byte
elements scatter 4-8x faster than bytes on CPU); it runs to completion inside
``submit_*`` and is reported by the next ``get_finished``. Only
``blocks_per_chunk == 1`` (offload chunk = engine block) is supported.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

SPEC_NAME = "CPUCopyOffloadingSpec"
SPEC_MODULE = "vllm_cpu_offload_spec"


def spec_config(cpu_bytes: int) -> dict[str, Any]:
    """The ``kv_transfer_config`` dict selecting the native connector with this spec."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "spec_name": SPEC_NAME,
            "spec_module_path": SPEC_MODULE,
            "cpu_bytes_to_use": int(cpu_bytes),
        },
    }


def _word_view(rows: torch.Tensor) -> torch.Tensor:
    """View a 2-D byte tensor as int64 words when its rows allow it, else as bytes."""
    row_bytes = rows.shape[1]
    if row_bytes % 8 == 0 and rows.stride(0) % 8 == 0 and rows.storage_offset() % 8 == 0:
        return rows.view(torch.int64)
    return rows


def _index(ids: npt.NDArray[Any]) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))


class CPUCopyWorker(OffloadingWorker):
    """Copies engine KV blocks to host rows and back, synchronously, on the CPU.

    Owns the host buffers. The engine tensors are borrowed views of vLLM's KV cache;
    the worker writes them only inside ``submit_load``. ``get_finished`` hands back
    (and forgets) the results of every job submitted since the previous call.
    ``blocks_stored`` / ``blocks_loaded`` count engine blocks copied each way.
    """

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, num_chunks: int):
        if blocks_per_chunk != 1:
            raise ValueError(
                f"blocks_per_chunk: {blocks_per_chunk} unsupported by {SPEC_NAME}; accepted: 1 "
                "(leave block_size/blocks_per_chunk unset in kv_connector_extra_config)"
            )
        self._engine = [_word_view(t.tensor.view(torch.int8)) for t in kv_caches.tensors]
        self._host = [
            _word_view(torch.zeros((num_chunks, t.page_size_bytes), dtype=torch.int8))
            for t in kv_caches.tensors
        ]
        self._page_bytes = [t.page_size_bytes for t in kv_caches.tensors]
        self._tensors_per_group = [
            sorted({ref.tensor_idx for ref in refs}) for refs in kv_caches.group_data_refs
        ]
        self._finished: list[TransferResult] = []
        self.blocks_stored = 0
        self.blocks_loaded = 0

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._transfer(job_id, src_spec, _chunks(dst_spec), to_host=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._transfer(job_id, dst_spec, _chunks(src_spec), to_host=False)

    def get_finished(self) -> list[TransferResult]:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Every job is finished when ``submit_*`` returns: nothing to wait for."""

    def _transfer(
        self, job_id: int, blocks: GPULoadStoreSpec, chunks: npt.NDArray[Any], *, to_host: bool
    ) -> bool:
        start = time.perf_counter()
        sizes = list(blocks.group_sizes)
        if len(blocks.block_ids) != len(chunks) or len(sizes) != len(self._tensors_per_group):
            raise ValueError(
                f"job {job_id}: {len(blocks.block_ids)} engine blocks in {len(sizes)} groups "
                f"vs {len(chunks)} host chunks in {len(self._tensors_per_group)} groups"
            )
        moved = 0
        offset = 0
        for size, tensor_ids in zip(sizes, self._tensors_per_group, strict=True):
            if size == 0:
                continue
            block_idx = _index(blocks.block_ids[offset : offset + size])
            chunk_idx = _index(chunks[offset : offset + size])
            offset += size
            for t in tensor_ids:
                engine, host = self._engine[t], self._host[t]
                if to_host:
                    host.index_copy_(0, chunk_idx, engine.index_select(0, block_idx))
                else:
                    engine.index_copy_(0, block_idx, host.index_select(0, chunk_idx))
                moved += size * self._page_bytes[t]
        if to_host:
            self.blocks_stored += len(chunks)
        else:
            self.blocks_loaded += len(chunks)
        self._finished.append(TransferResult(job_id, True, moved, time.perf_counter() - start))
        return True


def _chunks(spec: LoadStoreSpec) -> npt.NDArray[Any]:
    if not isinstance(spec, BlockIDsLoadStoreSpec):
        raise TypeError(f"expected a block-id spec for host chunks, got {type(spec).__name__}")
    return spec.block_ids


class CPUCopyOffloadingSpec(CPUOffloadingSpec):
    """``CPUOffloadingSpec`` (manager, sizing from ``cpu_bytes_to_use``) + ``CPUCopyWorker``."""

    _copy_worker: CPUCopyWorker | None = None

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._copy_worker is None:
            self._copy_worker = CPUCopyWorker(kv_caches, self.blocks_per_chunk, self.num_chunks)
        return self._copy_worker
