"""The transfer worker copies through a :class:`SharedSlab` as through a private
host slab: one engine stores chunks with its worker, another engine (its own mapping
of the share) loads them into its own blocks, byte for byte."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from kvoffload.core.jobs import JobKind
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.paths import SharePaths
from kvoffload.share.server_start import open_server
from kvoffload.tiers.host_shared_slab import SharedSlab
from kvoffload.transfer import TransferWorker, register_kv_caches

ENGINES_FILE = Path(__file__).parents[1] / "unit" / "transfer" / "kv_engines.py"
BLOCKS, K = 24, 2


def kv_engines():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("share_kv_engines", ENGINES_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_two_engines_copy_through_one_shared_slab(share_root: Path) -> None:
    engines = kv_engines()
    one, two = engines.vllm_cpu(BLOCKS), engines.vllm_cpu(BLOCKS)
    layouts = [register_kv_caches(e.caches, e.num_blocks) for e in (one, two)]
    chunk = layouts[0].chunk_bytes(K)
    paths = SharePaths("copy", share_root)
    server = open_server(paths, ShareGeometry(num_slots=6, slot_bytes=chunk))
    try:
        slabs = [SharedSlab(paths, server.geometry, 0, chunk, pin_memory=False) for _ in "ab"]
        writer = TransferWorker(layouts[0], slabs[0], K)  # type: ignore[arg-type]
        reader = TransferWorker(layouts[1], slabs[1], K)  # type: ignore[arg-type]
        slots, stored_blocks, load_blocks = [4, 1], [3, 9, 10, 2], [20, 5, 7, 11]
        writer.submit_store(engines.job(1, JobKind.STORE, slots, stored_blocks, K))
        writer.wait([1])
        assert [r.success for r in writer.poll()] == [True]
        untouched = {b: engines.record(two, b) for b in range(BLOCKS) if b not in load_blocks}
        reader.submit_load(engines.job(2, JobKind.LOAD, slots, load_blocks, K))
        reader.wait([2])
        assert [r.success for r in reader.poll()] == [True]
        for src, dst in zip(stored_blocks, load_blocks, strict=True):
            assert engines.record(two, dst) == engines.record(one, src)
        assert {b: engines.record(two, b) for b in untouched} == untouched
        writer.shutdown()
        reader.shutdown()
    finally:
        server.close()
