"""Tier loads on the real worker: chunks read from a real disk slab or Redis server
straight into engine blocks through the staging area, verified first. No sleeps: a
test waits for the jobs it submitted; a store that blocks is released by the test."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from kv_engines import Engine, record, vllm_cpu

from kvoffload.core.failures import ChunkFailure, FailureKind, error_failure, integrity_failure
from kvoffload.core.jobs import NO_BLOCK, NO_SLOT, EngineJob, JobKind, JobResult, StepPlan, TierJob
from kvoffload.core.keys import ChunkKey
from kvoffload.testing.redis_server import RedisServer
from kvoffload.tiers.disk import PAYLOAD_OFFSET, DiskStore
from kvoffload.tiers.disk_store import DiskTierStore
from kvoffload.tiers.redis_client import RedisSettings, make_client
from kvoffload.tiers.redis_store import RedisStore
from kvoffload.transfer import TransferWorker
from kvoffload.transfer.staged_loads import StagedLoads
from kvoffload.transfer.step_backend import TransferBackend
from kvoffload.transfer.tier_worker import TierStore, TierWorker

N, K, HOST_SLOTS = 40, 2, 8
CHUNK = K * 3 * 256  # vllm_cpu: 3 layers of 256-byte pages per block
DIGEST = bytes(range(16))
TIMEOUT = 30.0  # only so that a broken test fails instead of hanging


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


class Reads:
    """A tier store that records the size of every ``read_many`` and, once ``hold``
    is cleared, blocks in it until released (``entered`` is set then)."""

    def __init__(self, inner: TierStore) -> None:
        self.inner = inner
        self.sizes: list[int] = []
        self.go = threading.Event()
        self.go.set()
        self.entered = threading.Event()

    def write_many(
        self,
        items: Sequence[tuple[ChunkKey, memoryview]],
        slots: Sequence[int],
        groups: Sequence[int] = (),
    ) -> list[ChunkFailure | None]:
        return self.inner.write_many(items, slots, groups)

    def read_many(
        self,
        keys: Sequence[ChunkKey],
        slots: Sequence[int],
        outs: Sequence[memoryview],
        groups: Sequence[int] = (),
    ) -> list[ChunkFailure | None]:
        self.sizes.append(len(keys))
        self.entered.set()
        assert self.go.wait(TIMEOUT), "held read never released"
        return self.inner.read_many(keys, slots, outs, groups)


class Rig:
    """An engine, its transfer worker and host slab, a disk slab (and a Redis store),
    the tier lane, staged loads of ``staging`` chunks per tier, and the backend."""

    def __init__(self, root: Path, server: RedisServer | None, staging: int) -> None:
        self.engine: Engine = vllm_cpu(N)
        self.worker = TransferWorker.for_kv_caches(
            self.engine.caches, N, blocks_per_chunk=K, host_budget_bytes=HOST_SLOTS * CHUNK
        )
        assert self.worker.slab.chunk_bytes == CHUNK
        self.disk = DiskStore(root, DIGEST, 0, CHUNK, num_slots=16, groups=2)
        stores: dict[str, TierStore] = {"disk": Reads(DiskTierStore(self.disk))}
        if server is not None:
            client = make_client(RedisSettings(server.url, timeout_ms=300))
            stores["redis"] = Reads(RedisStore(client, DIGEST, 0, CHUNK, groups=2))
        self.tiers = TierWorker(self.worker.slab, stores)
        self.staged = StagedLoads.open(
            self.worker, self.tiers.stores, staging_bytes=staging * CHUNK * len(stores)
        )
        self.backend = TransferBackend(
            self.worker, self.tiers, wait_for_loads=True, staged=self.staged
        )
        self.next_id = 1

    def reads(self, tier: str) -> Reads:
        store = self.tiers.stores[tier]
        assert isinstance(store, Reads)
        return store

    def job_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def run(self, job: EngineJob | TierJob) -> JobResult:
        """Submit ``job`` through the backend, wait for it, poll its one result."""
        if isinstance(job, EngineJob) and job.kind is JobKind.LOAD:
            self.backend.begin(StepPlan(self.next_id, loads=(job,)))
        else:
            self.backend.begin(StepPlan(self.next_id))
        self.backend.submit(job)
        for lane in (self.worker, self.tiers, self.staged):
            lane.wait([job.job_id])
        (report,) = self.backend.poll()
        (result,) = report.results
        return result

    def put(
        self, tier: str, chunks: dict[int, tuple[int, int]], groups: Sequence[int] = ()
    ) -> None:
        """Store the engine blocks of ``chunks`` (key -> (first block, tier slot)) into
        host slots, then spill them to ``tier`` (as ``groups``)."""
        keys = tuple(key(k) for k in chunks)
        slots = tuple(range(len(chunks)))
        blocks = tuple(b for first, _ in chunks.values() for b in range(first, first + K))
        store = EngineJob(self.job_id(), JobKind.STORE, "writer", keys, slots, blocks, K)
        assert self.run(store).success
        tier_slots = tuple(at for _, at in chunks.values())
        spill = TierJob(
            self.job_id(), JobKind.SPILL, keys, slots, tier, tier_slots, None, tuple(groups)
        )
        assert self.run(spill).success

    def blocks(self, blocks: Sequence[int]) -> list[bytes]:
        return [record(self.engine, b) for b in blocks]

    def close(self) -> None:
        self.staged.shutdown()
        self.tiers.shutdown()
        self.worker.shutdown()


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    built = Rig(tmp_path, None, staging=2)
    try:
        yield built
    finally:
        built.close()


def tier_load(
    job_id: int,
    keys: Sequence[int],
    slots: Sequence[int],
    blocks: Sequence[int],
    *,
    tier: str = "disk",
    at: Sequence[int] = (),
    groups: Sequence[int] = (),
    skip: int = 0,
) -> EngineJob:
    return EngineJob(
        job_id,
        JobKind.LOAD,
        "reader",
        tuple(key(k) for k in keys),
        tuple(slots),
        tuple(blocks),
        K,
        skip,
        tier=tier,
        tier_slots=tuple(at),
        groups=tuple(groups),
    )


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_a_tier_load_puts_the_tiers_bytes_into_the_engine_blocks(
    tmp_path: Path, redis_server: RedisServer, tier: str
) -> None:
    rig = Rig(tmp_path, redis_server, staging=2)
    try:
        rig.put(tier, {1: (0, 5), 2: (2, 9)})  # blocks 0-1 at tier slot 5, 2-3 at 9
        want = rig.blocks(range(4))
        at = (5, 9) if tier == "disk" else ()  # Redis is keyed by chunk, not slotted
        job = tier_load(rig.job_id(), [1, 2], [NO_SLOT] * 2, range(10, 14), tier=tier, at=at)
        result = rig.run(job)
        assert result.success and result.failed_chunks == () and result.error == ""
        assert result.nbytes == 2 * CHUNK
        assert rig.blocks(range(10, 14)) == want
        assert rig.backend.take_loaded() == {"reader"}
        assert rig.backend.take_invalid_blocks() == set()
        # A host load of the same chunks (still in host slots 0 and 1) agrees.
        host = EngineJob(rig.job_id(), JobKind.LOAD, "h", job.keys, (0, 1), tuple(range(20, 24)), K)
        assert rig.run(host).success
        assert rig.blocks(range(20, 24)) == rig.blocks(range(10, 14))
    finally:
        rig.close()


def test_a_load_larger_than_the_staging_area_goes_in_parts(rig: Rig) -> None:
    rig.put("disk", {k: (2 * k, k) for k in range(5)})  # 5 chunks, blocks 0-9
    want = rig.blocks(range(10))
    assert rig.staged.staging_slots == {"disk": 2}
    reads = rig.reads("disk")
    reads.sizes.clear()
    job = tier_load(rig.job_id(), range(5), [NO_SLOT] * 5, range(20, 30), at=range(5))
    result = rig.run(job)
    assert result.success and result.nbytes == 5 * CHUNK
    assert reads.sizes == [2, 2, 1]
    assert rig.blocks(range(20, 30)) == want


def flip_payload_byte(disk: DiskStore, tier_slot: int) -> None:
    offset = disk.offset(tier_slot) + PAYLOAD_OFFSET + CHUNK // 2
    with open(disk.path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("bad", [1, 2])  # in the first part, or in the second
def test_a_corrupt_chunk_fails_the_load_and_never_reaches_an_engine_block(
    rig: Rig, bad: int
) -> None:
    rig.put("disk", {k: (2 * k, k) for k in range(3)})
    flip_payload_byte(rig.disk, bad)
    blocks = range(20, 26)
    before = rig.blocks(blocks)
    reads = rig.reads("disk")
    reads.sizes.clear()
    result = rig.run(tier_load(rig.job_id(), range(3), [NO_SLOT] * 3, blocks, at=range(3)))
    assert not result.success
    assert result.failed_chunks == ((bad, integrity_failure("checksum")),)
    assert result.error == integrity_failure("checksum")
    assert reads.sizes == ([2] if bad == 1 else [2, 1])  # the load stops at the bad part
    landed = 0 if bad == 1 else 2  # chunks copied before the bad part
    assert result.nbytes == landed * CHUNK
    assert rig.blocks(blocks)[landed * K :] == before[landed * K :]  # none of the bad part
    assert rig.blocks(blocks)[: landed * K] == rig.blocks(range(landed * K))
    assert rig.backend.take_invalid_blocks() == set(blocks)  # the engine recomputes them
    assert rig.backend.take_loaded() == {"reader"}
    again = rig.run(tier_load(rig.job_id(), [bad], [NO_SLOT], [30, 31], at=[bad]))
    assert again.failed_chunks == ((0, integrity_failure("magic")),)  # the bad copy is gone


def test_a_mixed_job_reads_host_and_tier_chunks(rig: Rig) -> None:
    rig.put("disk", {1: (0, 3), 2: (2, 4), 3: (4, 6)})  # host slots 0-2, tier slots 3, 4, 6
    want = rig.blocks(range(6))
    # Chunk 0 from host slot 0 (its first block computed by the engine: skip 1),
    # chunk 1 from disk, chunk 2 from host slot 2 (its second block left out).
    job = tier_load(
        rig.job_id(), [1, 2, 3], [0, NO_SLOT, 2], [21, 22, 23, 24, NO_BLOCK], at=[4], skip=1
    )
    result = rig.run(job)
    assert result.success and result.failed_chunks == ()
    assert result.nbytes == 4 * (CHUNK // K)  # four block records moved
    assert rig.blocks([21, 22, 23, 24]) == want[1:5]


def test_a_failed_host_half_fails_the_job_after_the_tier_half(rig: Rig) -> None:
    rig.put("disk", {1: (0, 3)})
    job = tier_load(rig.job_id(), [1, 1], [NO_SLOT, HOST_SLOTS + 5], [20, 21, 22, 23], at=[3])
    result = rig.run(job)  # the host slot is out of range: the host half fails
    assert not result.success and "out of range" in str(result.error)
    assert result.failed_chunks == ()  # the tier chunk landed
    assert rig.backend.take_invalid_blocks() == {20, 21, 22, 23}


def test_a_chunk_of_another_kv_cache_group_fails_as_a_group_mismatch(rig: Rig) -> None:
    rig.put("disk", {1: (0, 3), 2: (2, 4)}, groups=[0, 1])
    before = rig.blocks(range(20, 24))
    job = tier_load(rig.job_id(), [1, 2], [NO_SLOT] * 2, range(20, 24), at=[3, 4], groups=[0, 0])
    result = rig.run(job)
    assert not result.success
    assert result.failed_chunks == ((1, integrity_failure("group")),)
    assert rig.blocks(range(20, 24)) == before  # the part had a bad chunk: nothing copied
    ok = tier_load(rig.job_id(), [1], [NO_SLOT], [30, 31], at=[3], groups=[0])
    assert rig.run(ok).success and rig.blocks([30, 31]) == rig.blocks([0, 1])


def test_a_dead_redis_fails_every_tier_chunk_without_raising(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    rig = Rig(tmp_path, redis_server, staging=2)
    try:
        rig.put("redis", {1: (0, 0), 2: (2, 0), 3: (4, 0)})
        redis_server.kill()
        job = tier_load(rig.job_id(), [1, 2, 3], [NO_SLOT, 1, NO_SLOT], range(20, 26), tier="redis")
        result = rig.run(job)
        assert not result.success and "ConnectionError" in str(result.error)
        assert [i for i, _ in result.failed_chunks] == [0, 2]
        assert all(f.kind is FailureKind.ERROR for _, f in result.failed_chunks)
        assert rig.blocks([22, 23]) == rig.blocks([2, 3])  # the host chunk landed
        assert rig.backend.take_invalid_blocks() == set(range(20, 26))
    finally:
        rig.close()


def test_a_tier_without_a_store_fails_at_once(rig: Rig) -> None:
    job = tier_load(rig.job_id(), [1], [NO_SLOT], [20, 21], tier="nfs")
    result = rig.run(job)
    assert not result.success
    assert result.failed_chunks == ((0, error_failure("no tier 'nfs' on this worker")),)
    bare = TransferBackend(rig.worker, None, wait_for_loads=True)  # no lower tier at all
    bare.begin(StepPlan(1, loads=(job,)))
    bare.submit(job)
    (report,) = bare.poll()
    (result,) = report.results
    assert not result.success and [i for i, _ in result.failed_chunks] == [0]
    assert bare.take_invalid_blocks() == {20, 21} and bare.take_loaded() == {"reader"}


def test_poll_does_not_wait_for_a_tier_read(rig: Rig) -> None:
    rig.put("disk", {1: (0, 3), 2: (2, 4)})
    reads = rig.reads("disk")
    reads.go.clear()
    reads.entered.clear()
    job = tier_load(rig.job_id(), [1, 2], [NO_SLOT, 1], range(20, 24), at=[3])
    rig.backend.begin(StepPlan(50, loads=(job,)))
    rig.backend.submit(job)
    assert reads.entered.wait(TIMEOUT)
    assert rig.backend.poll()[0].results == ()  # the host half is done, the read is not
    assert rig.backend.take_loaded() == set()
    reads.go.set()
    assert rig.staged.wait([job.job_id], TIMEOUT)
    (result,) = rig.backend.poll()[0].results
    assert result.success and rig.backend.take_loaded() == {"reader"}
    assert rig.blocks(range(20, 24)) == rig.blocks(range(4))


def test_shutdown_fails_staged_loads_and_never_raises(rig: Rig) -> None:
    rig.put("disk", {1: (0, 3), 2: (2, 4)})
    reads = rig.reads("disk")
    reads.go.clear()
    reads.entered.clear()
    running = tier_load(rig.job_id(), [1], [NO_SLOT], [20, 21], at=[3])
    queued = tier_load(rig.job_id(), [2], [NO_SLOT], [22, 23], at=[4])
    rig.staged.submit(running)
    assert reads.entered.wait(TIMEOUT)
    rig.staged.submit(queued)
    rig.staged.shutdown(timeout=0.0)
    results = {r.job_id: r for r in rig.staged.poll()}
    assert "abandoned" in str(results[running.job_id].error)
    assert "cancelled" in str(results[queued.job_id].error)
    assert not any(r.success for r in results.values())
    reads.go.set()  # the abandoned read ends; its late result is dropped
    late = tier_load(rig.job_id(), [1], [NO_SLOT], [24, 25], at=[3])
    rig.staged.submit(late)
    (result,) = rig.staged.poll()
    assert result.job_id == late.job_id and "shut down" in str(result.error)
    rig.staged.shutdown()  # idempotent
    assert rig.staged.poll() == []


def test_parts_keep_the_first_chunks_skipped_blocks(rig: Rig) -> None:
    rig.put("disk", {k: (2 * k, k) for k in range(3)})
    want = rig.blocks(range(6))
    before = record(rig.engine, 20)
    job = tier_load(rig.job_id(), range(3), [NO_SLOT] * 3, range(21, 26), at=range(3), skip=1)
    result = rig.run(job)  # parts [0, 1] (block 0 of chunk 0 skipped) and [2]
    assert result.success and result.nbytes == 5 * (CHUNK // K)
    assert rig.blocks(range(21, 26)) == want[1:]
    assert record(rig.engine, 20) == before
