"""A node-shared host slab (issue 41): another engine of the share (its own mapping of
the same rank file, as a ``host_share_group`` member has) changes one bit of a slot
this engine stored through a codec; this engine's load of that slot fails its frame
checksum (the job fails, no engine block is written), and its other slot loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from share_fixtures import serve_in_thread, stop_thread

from kvoffload.codecs.chunk_codec import open_codec
from kvoffload.core.jobs import EngineJob, JobKind, JobResult
from kvoffload.core.keys import ChunkKey
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.paths import SharePaths
from kvoffload.tiers.host_shared_slab import SharedSlab
from kvoffload.transfer import TransferWorker, register_kv_caches

BLOCKS = 8


def load_or_store(job_id: int, kind: JobKind, slots: list[int], blocks: list[int]) -> EngineJob:
    keys = tuple(ChunkKey(bytes([job_id, i]) * 8) for i in range(len(slots)))
    return EngineJob(job_id, kind, f"r{job_id}", keys, tuple(slots), tuple(blocks), 1, 0)


@pytest.mark.parametrize("codec", ["lossless", "fp8"])
def test_a_slot_another_engine_changed_fails_its_load(share_root: Path, codec: str) -> None:
    g = torch.Generator().manual_seed(8)
    caches = {f"l{i}": torch.randn(BLOCKS, 2, 4, 64, generator=g) for i in range(2)}
    raw = register_kv_caches(caches, BLOCKS).chunk_bytes(1)
    chunk = open_codec(codec, torch.float32, raw)
    assert chunk is not None
    paths = SharePaths(f"frames-{codec}", share_root)
    server, thread = serve_in_thread(
        paths, ShareGeometry(num_slots=4, slot_bytes=chunk.stored_bytes)
    )
    mine = SharedSlab(paths, server.geometry, 0, chunk.stored_bytes, pin_memory=False)
    other = SharedSlab(paths, server.geometry, 0, chunk.stored_bytes, pin_memory=False)
    worker = TransferWorker(register_kv_caches(caches, BLOCKS), mine, 1, threads=1, codec=chunk)

    def run(job: EngineJob) -> JobResult:
        (worker.submit_store if job.kind is JobKind.STORE else worker.submit_load)(job)
        worker.wait([job.job_id])
        (result,) = worker.poll()
        return result

    try:
        assert run(load_or_store(1, JobKind.STORE, [0, 3], [0, 1])).success
        slot = other.slot_tensor(3)  # the other engine's view of the same slot
        slot[64] ^= 0x20
        before = {name: t[6].clone() for name, t in caches.items()}
        failed = run(load_or_store(2, JobKind.LOAD, [3], [6]))
        assert not failed.success and "checksum" in str(failed.error)
        assert all(torch.equal(caches[name][6], before[name]) for name in caches)
        assert run(load_or_store(3, JobKind.LOAD, [0], [7])).success
        if codec == "lossless":
            assert all(torch.equal(t[7], t[0]) for t in caches.values())
    finally:
        worker.shutdown()
        mine.close()
        other.close()
        stop_thread(server, thread)
