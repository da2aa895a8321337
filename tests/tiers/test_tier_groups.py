"""KV cache groups below host memory: a chunk spilled as group ``g`` is written with
``g`` in its header and comes back as ``g``; read back for another group it is an
integrity miss (reason ``group``), counted by the tier planner and deleted from the
tier, never bytes handed out as the wrong group's."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvoffload.core.chunk_format import (
    HEADER_BYTES,
    IntegrityError,
    IntegrityReason,
    header_group,
)
from kvoffload.core.directory import Directory
from kvoffload.core.failures import integrity_failure
from kvoffload.core.jobs import JobResult, TierJob
from kvoffload.core.keys import ChunkKey
from kvoffload.core.tiering.lower import DirectoryTier
from kvoffload.core.tiering.planning import TierPlanner
from kvoffload.testing.redis_server import RedisServer
from kvoffload.tiers.disk import DiskStore
from kvoffload.tiers.disk_store import DiskTierStore
from kvoffload.tiers.host import HostSlab
from kvoffload.tiers.redis_client import RedisSettings, key_name, make_client
from kvoffload.tiers.redis_store import RedisStore
from kvoffload.transfer.tier_worker import TierWorker

DIGEST = bytes(range(16))
CHUNK = 4096
GROUPS = 2

ids = itertools.count(1).__next__


def K(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def run(worker: TierWorker, job: TierJob) -> JobResult:
    worker.submit(job)
    assert worker.wait([job.job_id], timeout=30)
    (result,) = worker.poll()
    return result


class Setup:
    """A host directory and slab, the disk tier's directory and slab, a grouped
    planner over them and the worker's tier lane."""

    def __init__(self, root: Path) -> None:
        self.host = Directory(8)
        self.disk = DirectoryTier(Directory(8, tier="disk"))
        self.planner = TierPlanner(self.host, [self.disk], chunk_tokens=16, grouped=True)
        self.slab = HostSlab(CHUNK, 8 * CHUNK, pin_memory=False)
        self.store = DiskStore(root, DIGEST, 0, CHUNK, num_slots=8, groups=GROUPS)
        self.worker = TierWorker(self.slab, {"disk": DiskTierStore(self.store)})

    def store_on_host(self, keys: list[ChunkKey], groups: list[int]) -> None:
        """Host stores of ``keys`` (of ``groups``) that completed, their bytes in the slab."""
        prepared = self.host.prepare_store(keys, groups=groups)
        for key, slot in zip(prepared.keys, prepared.slots, strict=True):
            self.slab.slot_bytes(slot)[:] = key * (CHUNK // 16)
        self.host.complete_store(prepared.keys, success=True)
        self.planner.note_stored(keys)

    def promote(self, keys: list[ChunkKey], groups: list[int]) -> tuple[TierJob, JobResult]:
        """Evict ``keys`` from host memory, promote them back as ``groups``, book it."""
        self.host.discard(keys)
        job = self.planner.plan_promotion("r", "disk", keys, ids, groups)
        assert job is not None
        result = run(self.worker, job)
        self.planner.complete(job, result)
        return job, result


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    built = Setup(tmp_path)
    try:
        yield built
    finally:
        built.worker.shutdown()


def test_a_spilled_chunk_of_group_1_comes_back_as_group_1(setup: Setup) -> None:
    keys = [K(1), K(2)]
    setup.store_on_host(keys, [0, 1])
    (spill,) = setup.planner.plan_spills(ids)
    assert spill.groups == (0, 1)  # read from the host directory's slots
    result = run(setup.worker, spill)
    assert result.success and result.failed_chunks == ()
    setup.planner.complete(spill, result)
    with open(setup.store.path, "rb") as f:  # each header names its chunk's group
        for tier_slot, group in zip(spill.tier_slots, (0, 1), strict=True):
            f.seek(setup.store.offset(tier_slot))
            assert header_group(f.read(HEADER_BYTES)) == (group, GROUPS)

    job, result = setup.promote(keys, [0, 1])
    assert job.groups == (0, 1)
    assert result.success and result.failed_chunks == ()
    slots = [setup.host.slot_of(key) for key in keys]
    assert all(slot is not None for slot in slots)
    assert setup.host.groups_of([s for s in slots if s is not None]) == (0, 1)
    for key, slot in zip(job.keys, job.slots, strict=True):
        assert bytes(setup.slab.slot_bytes(slot)) == key * (CHUNK // 16)
    assert setup.disk.metrics.value("integrity_errors_total", reason="group") == 0


def test_a_chunk_read_back_for_another_group_is_a_counted_integrity_miss(setup: Setup) -> None:
    keys = [K(1), K(2)]
    setup.store_on_host(keys, [1, 1])
    (spill,) = setup.planner.plan_spills(ids)
    setup.planner.complete(spill, run(setup.worker, spill))
    tier_slot = setup.disk.directory.slot_of(K(2))
    assert tier_slot is not None

    job, result = setup.promote(keys, [1, 0])  # the planner wants K(2) as group 0
    assert job.groups == (1, 0)
    assert result.success and result.failed_chunks == ((1, integrity_failure("group")),)
    assert setup.disk.metrics.value("integrity_errors_total", reason="group") == 1
    assert setup.disk.metrics.value("failed_chunks_total", direction="promote") == 1
    assert K(1) in setup.host and K(2) not in setup.host  # the bad one took no host slot
    assert setup.disk.present_run([K(2)]) == 0  # forgotten by the tier ...
    out = memoryview(bytearray(CHUNK))
    with pytest.raises(IntegrityError) as info:  # ... and cleared where it was found
        setup.store.read_into(tier_slot, K(2), out, group=1)
    assert info.value.reason is IntegrityReason.MAGIC


@pytest.mark.parametrize("zero_copy", [True, False])
def test_redis_values_keep_their_group_and_another_group_is_deleted(
    redis_server: RedisServer, zero_copy: bool
) -> None:
    client = make_client(RedisSettings(redis_server.url, timeout_ms=1000))
    store = RedisStore(client, DIGEST, 0, CHUNK, groups=GROUPS)
    store.zero_copy = store.zero_copy and zero_copy
    payloads = {K(1): bytes([1]) * CHUNK, K(2): bytes([2]) * CHUNK}
    items = [(key, memoryview(value)) for key, value in payloads.items()]
    assert store.write_many(items, (), [0, 1]) == [None, None]
    raw = redis_server.client()
    assert header_group(raw.getrange(store.name(K(2)), 0, HEADER_BYTES - 1)) == (1, GROUPS)
    assert header_group(raw.getrange(store.name(K(1)), 0, HEADER_BYTES - 1)) == (0, GROUPS)

    outs = [memoryview(bytearray(CHUNK)) for _ in payloads]
    assert store.read_many(list(payloads), (), outs, [0, 1]) == [None, None]
    assert [bytes(o) for o in outs] == list(payloads.values())

    outs = [memoryview(bytearray(CHUNK)) for _ in payloads]
    failures = store.read_many(list(payloads), (), outs, [0, 0])
    assert failures == [None, integrity_failure("group")]
    assert raw.exists(key_name(DIGEST, K(2), 0)) == 0  # deleted, as every bad value
    assert raw.exists(key_name(DIGEST, K(1), 0)) == 1
