"""The GPU's fp8 path (``transfer/cuda_codec_copy.py``) run on the CPU: this machine
has no GPU, so the CUDA streams and events are replaced by stand-ins that do nothing
(every copy here completes as it is made) and pinned memory by plain memory. What is
checked is everything else the GPU runs: the gather into chunks in slot order, the
encoding, the slot copies, the decoding and the scatter of the blocks a load names.
The slots it writes are byte for byte what the CPU path writes, and loads give back
the CPU path's values; a chunk with a value that is not finite fails the job once
its copy is done; slots are sealed with their checksum only then, and a load checks
each slot's checksum on the host before it enqueues anything (issue 41). On a GPU,
``scripts/gpu-check`` and ``test_transfer_roundtrip``'s CUDA test run the real
thing."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from kv_engines import Engine, gpu_style, job, record, vllm_cpu

from kvoffload.codecs.chunk_codec import Fp8Chunks
from kvoffload.codecs.frame_check import CorruptChunk
from kvoffload.core.jobs import JobKind
from kvoffload.tiers.host import HostSlab
from kvoffload.transfer import cuda_codec_copy, cuda_copy, register_kv_caches
from kvoffload.transfer.codec_copy import CodecCopier
from kvoffload.transfer.cuda_codec_copy import CudaCodecCopier
from kvoffload.transfer.plan import plan_job

NUM_BLOCKS = 20


class _Stream:
    def __init__(self, device: Any = None) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass


class _Event:
    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _Cuda:
    Stream = _Stream
    Event = _Event

    @staticmethod
    def current_stream(device: Any = None) -> None:
        return None

    @staticmethod
    @contextmanager
    def stream(stream: Any) -> Iterator[None]:
        yield


class _Torch:
    """torch, but CUDA's streams and events do nothing and pinned memory is plain."""

    cuda = _Cuda

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def empty(*args: Any, pin_memory: bool = False, **kwargs: Any) -> torch.Tensor:
        return torch.empty(*args, **kwargs)


@pytest.fixture
def no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (cuda_copy, cuda_codec_copy):
        monkeypatch.setattr(module, "torch", _Torch())


def finite(engine: Engine) -> Engine:
    g = torch.Generator().manual_seed(9)
    for t in engine.caches.values():
        t.copy_((torch.randn(t.shape, generator=g) * 3).to(t.dtype))
    return engine


class Rigs:
    """The same engine contents under the CPU path and the GPU path."""

    def __init__(self, make: Any, dtype: torch.dtype, k: int) -> None:
        self.k = k
        self.cpu_engine = finite(make(NUM_BLOCKS, dtype=dtype))
        self.gpu_engine = finite(make(NUM_BLOCKS, dtype=dtype))
        layouts = [
            register_kv_caches(e.caches, NUM_BLOCKS) for e in (self.cpu_engine, self.gpu_engine)
        ]
        self.codec = Fp8Chunks(dtype, layouts[0].chunk_bytes(k))
        size = self.codec.stored_bytes
        self.cpu_slab, self.gpu_slab = HostSlab(size, 6 * size), HostSlab(size, 6 * size)
        self.cpu = CodecCopier(layouts[0], self.cpu_slab, k, self.codec, threads=1)
        self.gpu = CudaCodecCopier(layouts[1], self.gpu_slab, k, self.codec)
        self.block_bytes = layouts[0].block_bytes
        self.ids = 0

    def plan(self, kind: JobKind, slots: list[int], blocks: list[int], skip: int = 0) -> Any:
        self.ids += 1
        return plan_job(
            job(self.ids, kind, slots, blocks, self.k, skip=skip), kind,
            num_blocks=NUM_BLOCKS, num_slots=6, blocks_per_chunk=self.k,
            block_bytes=self.block_bytes,
        )  # fmt: skip

    def both(self, kind: JobKind, slots: list[int], blocks: list[int], skip: int = 0) -> Any:
        plan = self.plan(kind, slots, blocks, skip)
        (self.cpu.store if kind is JobKind.STORE else self.cpu.load)(plan)
        flight = (self.gpu.store if kind is JobKind.STORE else self.gpu.load)(plan)
        assert flight.done()
        return flight


@pytest.mark.parametrize(
    ("make", "dtype"),
    [(gpu_style, torch.float16), (vllm_cpu, torch.bfloat16), (gpu_style, torch.float32)],
)
def test_the_gpu_path_writes_and_reads_what_the_cpu_path_does(
    no_gpu: None, make: Any, dtype: torch.dtype
) -> None:
    rigs = Rigs(make, dtype, k=2)
    flight = rigs.both(JobKind.STORE, [4, 1], [7, 2, 9, 3])  # slots out of order
    flight.verify()
    assert torch.equal(rigs.cpu_slab.data[[1, 4]], rigs.gpu_slab.data[[1, 4]])
    rigs.both(JobKind.LOAD, [4, 1], [11, 12, 13], skip=1)  # the first chunk's second block on
    for block in range(NUM_BLOCKS):
        assert record(rigs.cpu_engine, block) == record(rigs.gpu_engine, block)
    assert record(rigs.gpu_engine, 11) != record(rigs.gpu_engine, 7) or dtype is torch.float32


def test_a_chunk_that_is_not_finite_fails_once_done(no_gpu: None) -> None:
    rigs = Rigs(gpu_style, torch.float16, k=1)
    next(iter(rigs.gpu_engine.caches.values()))[0, 5].view(-1)[3] = float("inf")  # block 5
    plan = rigs.plan(JobKind.STORE, [0, 2], [4, 5])
    flight = rigs.gpu.store(plan)
    assert flight.finite is not None and flight.finite.tolist() == [True, False]
    with pytest.raises(ValueError, match="not finite"):
        flight.verify()
    for slot in (0, 2):  # neither slot was sealed: no load reads them
        with pytest.raises(CorruptChunk):
            rigs.gpu.load(rigs.plan(JobKind.LOAD, [slot], [9]))


def test_a_slot_that_changed_fails_its_load_before_anything_is_enqueued(no_gpu: None) -> None:
    rigs = Rigs(gpu_style, torch.bfloat16, k=1)
    store = rigs.plan(JobKind.STORE, [0, 2], [4, 5])
    flight = rigs.gpu.store(store)
    with pytest.raises(CorruptChunk):  # the copy is done but not verified: not sealed yet
        rigs.gpu.load(rigs.plan(JobKind.LOAD, [0], [9]))
    flight.verify()
    rigs.gpu_slab.data[2][100] ^= 0x04  # a value of the second chunk
    before = record(rigs.gpu_engine, 9)
    with pytest.raises(CorruptChunk, match="checksum"):
        rigs.gpu.load(rigs.plan(JobKind.LOAD, [2], [9]))
    assert record(rigs.gpu_engine, 9) == before
    rigs.gpu.load(rigs.plan(JobKind.LOAD, [0], [9]))  # the other slot loads
    assert record(rigs.gpu_engine, 9) != before
