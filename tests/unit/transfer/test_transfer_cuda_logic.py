"""The CUDA copy path's data movement, run on CPU tensors with stand-in streams.

No GPU exists where these tests were written: stream, event and stream-context calls
are replaced by inert stand-ins, so this checks which bytes go where (staging, runs,
page groups, skip_blocks), not asynchrony. ``test_cuda_round_trip`` covers a real GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from kv_engines import ENGINES, job, record, snapshot

from kvoffload.core.jobs import JobKind
from kvoffload.tiers.host import HostSlab
from kvoffload.transfer import register_kv_caches
from kvoffload.transfer.cuda_copy import CudaCopier
from kvoffload.transfer.plan import CopyPlan, plan_job


class FakeStream:
    def wait_stream(self, other: object) -> None:
        pass


class FakeEvent:
    def __init__(self, enable_timing: bool = False) -> None:
        pass

    def record(self, stream: object) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: object) -> float:
        return 0.0


@contextlib.contextmanager
def fake_stream_context(stream: object) -> Iterator[None]:
    yield


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", fake_stream_context)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())


@pytest.mark.parametrize("layout", sorted(ENGINES))
def test_cuda_path_moves_the_right_bytes(layout: str, fake_cuda: None) -> None:
    n, k = 24, 2
    engine = ENGINES[layout](n)
    lay = register_kv_caches(engine.caches, n)
    slab = HostSlab(lay.chunk_bytes(k), 6 * lay.chunk_bytes(k), pin_memory=False)
    copier = CudaCopier(lay, slab, k)

    def plan(kind: JobKind, slots: list[int], blocks: list[int], skip: int = 0) -> CopyPlan:
        return plan_job(
            job(1, kind, slots, blocks, k, skip=skip),
            kind,
            num_blocks=n,
            num_slots=slab.num_slots,
            blocks_per_chunk=k,
            block_bytes=lay.block_bytes,
        )

    blocks = [9, 3, 17, 4, 5, 6]
    originals = {b: record(engine, b) for b in blocks}
    stored = copier.store(plan(JobKind.STORE, [4, 1, 2], blocks))
    assert stored.done() and stored.seconds() == 0.0
    assert bytes(slab.slot_bytes(4)) == originals[9] + originals[3]
    assert bytes(slab.slot_bytes(2)) == originals[5] + originals[6]
    before = snapshot(engine)
    copier.load(plan(JobKind.LOAD, [4, 1, 2], [20, 21, 22, 23, 0], skip=1))
    for target, source in zip([20, 21, 22, 23, 0], blocks[1:], strict=True):
        assert record(engine, target) == originals[source]
    for name, t in engine.caches.items():
        bdim = engine.block_dims[name]
        for block in set(range(n)) - {20, 21, 22, 23, 0}:
            assert torch.equal(
                t.view(torch.uint8).select(bdim, block), before[name].select(bdim, block)
            )
