"""The worker's tier lane: spills and promotions through host slots, per-chunk failures."""

from __future__ import annotations

from pathlib import Path

from kvoffload.core.failures import MISSING, integrity_failure
from kvoffload.core.jobs import JobKind, JobResult, TierJob
from kvoffload.core.keys import ChunkKey
from kvoffload.testing.redis_server import RedisServer
from kvoffload.tiers.disk import DiskStore
from kvoffload.tiers.disk_store import DiskTierStore
from kvoffload.tiers.host import HostSlab
from kvoffload.tiers.redis_client import RedisSettings, make_client
from kvoffload.tiers.redis_store import RedisStore
from kvoffload.transfer.tier_worker import TierStore, TierWorker

DIGEST = bytes(range(16))
CHUNK = 4096


def K(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def job(
    job_id: int,
    kind: JobKind,
    *,
    tier: str,
    keys: list[int],
    slots: list[int],
    at: list[int] | None = None,
) -> TierJob:
    """A tier job for ``keys`` in host ``slots``, at tier slots ``at`` (default: the
    same numbers as the host slots)."""
    return TierJob(
        job_id,
        kind,
        tuple(K(k) for k in keys),
        tuple(slots),
        tier,
        tuple(slots if at is None else at),
        request_id="r" if kind is JobKind.PROMOTE else None,
    )


def run(worker: TierWorker, j: TierJob) -> JobResult:
    worker.submit(j)
    worker.wait([j.job_id])
    (result,) = worker.poll()
    return result


def make(
    tmp_path: Path, server: RedisServer | None = None, part_bytes: int = 8 << 20
) -> TierWorker:
    slab = HostSlab(CHUNK, 8 * CHUNK, pin_memory=False)
    for slot in range(8):
        slab.slot_bytes(slot)[:] = bytes([slot]) * CHUNK
    disk = DiskStore(tmp_path, DIGEST, 0, CHUNK, num_slots=8)
    stores: dict[str, TierStore] = {"disk": DiskTierStore(disk)}
    if server is not None:
        client = make_client(RedisSettings(server.url, timeout_ms=300))
        stores["redis"] = RedisStore(client, DIGEST, 0, CHUNK)
    return TierWorker(slab, stores, part_bytes=part_bytes)


def test_spill_then_promote_round_trips_through_both_tiers(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    w = make(tmp_path, redis_server)
    try:
        for n, tier in enumerate(("disk", "redis")):
            spill = job(2 * n + 1, JobKind.SPILL, tier=tier, keys=[1, 2], slots=[1, 2], at=[4, 0])
            assert run(w, spill).success
            promote = job(
                2 * n + 2, JobKind.PROMOTE, tier=tier, keys=[1, 2], slots=[6, 7], at=[4, 0]
            )
            result = run(w, promote)
            assert result.success and result.failed_chunks == ()
            assert bytes(w.slab.slot_bytes(6)) == bytes([1]) * CHUNK
            assert bytes(w.slab.slot_bytes(7)) == bytes([2]) * CHUNK
    finally:
        w.shutdown()


def test_a_bad_or_missing_chunk_fails_alone(tmp_path: Path, redis_server: RedisServer) -> None:
    w = make(tmp_path, redis_server)
    try:
        assert run(w, job(1, JobKind.SPILL, tier="disk", keys=[1, 2], slots=[1, 2])).success
        disk = w.stores["disk"]
        assert isinstance(disk, DiskTierStore)
        disk.store.clear(1)  # K(1)'s slot erased
        result = run(w, job(2, JobKind.PROMOTE, tier="disk", keys=[1, 2], slots=[5, 6], at=[1, 2]))
        assert result.success and result.failed_chunks == ((0, integrity_failure("magic")),)
        assert bytes(w.slab.slot_bytes(6)) == bytes([2]) * CHUNK
        nothing = run(w, job(3, JobKind.PROMOTE, tier="disk", keys=[1], slots=[5], at=[1]))
        assert not nothing.success and nothing.error == integrity_failure("magic")
        assert str(nothing.error) == "integrity:magic"  # the text logs show, as before
        assert run(w, job(4, JobKind.SPILL, tier="redis", keys=[3], slots=[3])).success
        result = run(w, job(5, JobKind.PROMOTE, tier="redis", keys=[9, 3], slots=[5, 6]))
        assert result.success and result.failed_chunks == ((0, MISSING),)
    finally:
        w.shutdown()


def test_a_dead_tier_fails_the_whole_job_without_raising(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    w = make(tmp_path, redis_server)
    try:
        redis_server.kill()
        result = run(w, job(1, JobKind.SPILL, tier="redis", keys=[1], slots=[1]))
        assert not result.success and "ConnectionError" in str(result.error)
        unknown = run(w, job(2, JobKind.SPILL, tier="nfs", keys=[1], slots=[1]))
        assert not unknown.success
    finally:
        w.shutdown()


def test_a_large_job_runs_in_parts_and_reports_failures_by_index(tmp_path: Path) -> None:
    w = make(tmp_path, part_bytes=2 * CHUNK)  # parts of two chunks: [0, 1] [2, 3] [4]
    try:
        keys, slots = [10, 11, 12, 13, 14], [0, 1, 2, 3, 4]
        assert run(w, job(1, JobKind.SPILL, tier="disk", keys=keys, slots=slots)).success
        disk = w.stores["disk"]
        assert isinstance(disk, DiskTierStore)
        disk.store.clear(2)  # one chunk gone in two parts
        disk.store.clear(4)
        result = run(
            w, job(2, JobKind.PROMOTE, tier="disk", keys=keys, slots=[3, 4, 5, 6, 7], at=slots)
        )
        assert result.failed_chunks == (
            (2, integrity_failure("magic")),
            (4, integrity_failure("magic")),
        )
        assert result.success
        assert result.nbytes == 3 * CHUNK
        assert [bytes(w.slab.slot_bytes(s))[0] for s in (3, 4, 6)] == [0, 1, 3]
    finally:
        w.shutdown()
