"""A disk share: the disk tier's slab files shared by the engines of a node through one
node process (``kvoffload.tiers.disk_backing``). Two engines share chunks; a killed
node process's successor recovers the complete chunks once its fence is open; a
private engine and a disk share never use one namespace at once."""

from __future__ import annotations

import os
import select
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvoffload.core.chunk_format import IntegrityError
from kvoffload.core.directory import LookupStatus
from kvoffload.core.errors import ConfigError, UsageError
from kvoffload.core.keys import ChunkKey
from kvoffload.inspection.disk_scan import inspect_disk
from kvoffload.share.backing import Recovered
from kvoffload.share.client import ShareDirectory
from kvoffload.share.fence import GenerationHold
from kvoffload.share.index import IndexReader
from kvoffload.share.launch import server_alive, spawn_server
from kvoffload.share.lifecycle import recorded_pid
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.serve import main as share_main
from kvoffload.share.server_start import open_server
from kvoffload.testing.share_process import stop_node_process
from kvoffload.tiers.disk import PAYLOAD_OFFSET, DiskStore
from kvoffload.tiers.disk_backing import DiskBacking, DiskBackingOptions
from kvoffload.tiers.disk_index import open_disk_tier
from kvoffload.tiers.disk_lock import DiskLock, check_workers_engine
from kvoffload.tiers.disk_node import disk_share
from kvoffload.tiers.node_shares import NodeLease, NodeShare, open_node_directory, serve_share

NS = bytes(range(16))


def share_of(share_root: Path, backing: DiskBacking, geometry: ShareGeometry) -> NodeShare:
    """The disk share as an engine of ``geometry`` opens it (its calls' deadline far
    past any call on a loaded machine)."""
    return disk_share(backing, share_root=share_root, geometry=geometry, timeout_s=30.0)


def ensure_disk_share(
    share_root: Path, backing: DiskBacking, geometry: ShareGeometry, wait_s: float
) -> ShareGeometry:
    """Start the disk share's node process unless one serves it; its geometry."""
    return serve_share(share_of(share_root, backing, geometry), wait_s).geometry


def open_disk_share_directory(
    share_root: Path, backing: DiskBacking, *, num_slots: int, chunk_bytes: int, ranks: int,
    wait_s: float = 60.0,
) -> ShareDirectory:  # fmt: skip
    """The scheduler half's directory of the disk share (a new session)."""
    share = share_of(share_root, backing, ShareGeometry(num_slots, chunk_bytes, ranks, "lru"))
    return open_node_directory(
        "disk", share, namespace=backing.namespace, session=os.urandom(16), wait_s=wait_s
    ).directory


PAYLOAD = 8192
SLOTS = 8
HIT, MISS = LookupStatus.HIT, LookupStatus.MISS


def K(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def chunk(key: ChunkKey, rank: int) -> bytes:
    """A chunk's bytes on one rank: different for every key and rank."""
    return (key[-1:] + bytes([rank])) * (PAYLOAD // 2)


class Engine:
    """An engine stand-in in the test process: the scheduler half's directory of the
    disk share and its workers' attached stores, one per rank."""

    def __init__(self, share_root: Path, backing: DiskBacking, ranks: int, **kw: object) -> None:
        self.directory = open_disk_share_directory(
            share_root, backing, num_slots=kw.pop("num_slots", SLOTS),  # type: ignore[arg-type]
            chunk_bytes=PAYLOAD, ranks=ranks,
        )  # fmt: skip
        geometry = ShareGeometry.read(backing.paths(share_root))
        assert geometry is not None
        self.stores = [
            DiskStore(backing.root, NS, rank, PAYLOAD, geometry.num_slots, attach=True)
            for rank in range(ranks)
        ]

    def store(self, *keys: ChunkKey) -> tuple[int, ...]:
        prepared = self.directory.prepare_store(keys)
        assert prepared.keys == keys
        for key, slot in zip(prepared.keys, prepared.slots, strict=True):
            for rank, store in enumerate(self.stores):
                store.write(slot, key, memoryview(chunk(key, rank)))
        self.directory.complete_store(prepared.keys, success=True)
        return prepared.slots

    def read(self, key: ChunkKey) -> list[bytes]:
        """Every rank's bytes of ``key``, verified (pinned while read)."""
        slot = self.directory.prepare_load([key])[0]
        try:
            out = []
            for store in self.stores:
                buffer = bytearray(PAYLOAD)
                store.read_into(slot, key, memoryview(buffer))
                out.append(bytes(buffer))
            return out
        finally:
            self.directory.complete_load([key])

    def close(self) -> None:
        self.directory.close()
        for store in self.stores:
            store.close()


@pytest.fixture
def backing(tmp_path: Path) -> DiskBacking:
    return DiskBacking(tmp_path / "disk", NS)


@pytest.fixture
def engines(share_root: Path, backing: DiskBacking) -> Iterator[Callable[..., Engine]]:
    """Engines on the disk share; its node process (started detached by the first
    one) is stopped by pid at teardown, and each engine closed."""
    started: list[Engine] = []

    def start(ranks: int = 1, **kw: object) -> Engine:
        engine = Engine(share_root, backing, ranks, **kw)
        started.append(engine)
        return engine

    try:
        yield start
    finally:
        for engine in started:
            engine.close()
        assert stop_node_process(backing.share_name(), share_root)


def kill_node_process(share_root: Path, backing: DiskBacking) -> None:
    """SIGKILL the share's node process and wait until it is gone (through a pidfd)."""
    paths = backing.paths(share_root)
    pid = recorded_pid(paths)
    assert pid is not None
    exited = os.pidfd_open(pid)
    try:
        os.kill(pid, 9)
        assert select.select([exited], [], [], 60.0)[0]
    finally:
        os.close(exited)
    assert not server_alive(paths)


def test_the_share_name_is_derived_from_the_real_path_and_the_namespace(tmp_path: Path) -> None:
    (tmp_path / "disk").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "disk")
    one = DiskBacking(tmp_path / "disk", NS)
    assert one.share_name() == DiskBacking(tmp_path / "link", NS).share_name()
    assert one.share_name() != DiskBacking(tmp_path / "disk", bytes(16)).share_name()
    assert one.share_name().startswith("disk-") and len(one.share_name()) == 21
    paths = one.paths(tmp_path)  # a valid name; runtime files in a directory of their own
    assert paths.socket.parent == tmp_path / f"kvoffload-u{os.geteuid()}" / one.share_name()


def test_two_engines_share_one_disk_tier(engines: Callable[..., Engine]) -> None:
    a, b = engines(), engines()
    assert a.directory.session != b.directory.session
    a.store(K(1))
    assert b.directory.readable_prefix([K(1), K(2)]) == 1
    assert b.directory.lookup([K(1), K(2)]).statuses == (HIT, MISS)
    assert b.read(K(1)) == [chunk(K(1), 0)]
    assert b.directory.prepare_store([K(1)]).keys == ()  # one copy, whoever stored it
    b.store(K(2))
    assert a.read(K(2)) == [chunk(K(2), 0)]
    assert a.directory.tier == "disk"
    a.directory.check_integrity()


def test_a_session_closed_mid_store_never_makes_its_slot_readable(
    engines: Callable[..., Engine],
) -> None:
    a, b = engines(), engines()
    prepared = a.directory.prepare_store([K(1)])
    a.stores[0].write(prepared.slots[0], K(1), memoryview(chunk(K(1), 0)))  # never completed
    a.close()  # the engine's last connection: its booking is freed
    assert b.directory.lookup([K(1)]).statuses == (MISS,)
    assert b.directory.readable_prefix([K(1)]) == 0
    assert b.directory.try_prepare_load([K(1)]) is None
    again = b.directory.prepare_store([K(1)])
    assert again.keys == (K(1),) and b.directory.free_slots == SLOTS - 1
    b.directory.complete_store(again.keys, success=False)
    b.directory.check_integrity()


def test_a_restarted_node_process_recovers_the_complete_chunks(
    share_root: Path, backing: DiskBacking, engines: Callable[..., Engine]
) -> None:
    a = engines(ranks=2)
    kept = a.store(K(1), K(2), K(4))
    a.close()  # no transfer of generation 1 in flight: the successor's fence is open
    kill_node_process(share_root, backing)
    r0, r1 = a.stores = [
        DiskStore(backing.root, NS, rank, PAYLOAD, SLOTS, attach=True) for rank in (0, 1)
    ]
    free = sorted(set(range(SLOTS)) - set(kept))
    for key, slot in ((K(3), free[0]), (K(5), free[1])):
        r0.write(slot, key, memoryview(chunk(key, 0)))
    r1.write(free[0], K(3), memoryview(chunk(K(3), 1)))  # K5: rank 0 only, incomplete
    _flip(r0, free[0], 8)  # K3: a torn header on rank 0 (its length field)
    _flip(r1, kept[2], PAYLOAD_OFFSET)  # K4: a torn payload on rank 1
    b = engines(ranks=2)  # starts generation 2, which recovers before serving
    assert b.directory.link.welcome is not None and b.directory.link.welcome.generation == 2
    assert b.directory.readable_prefix([K(1), K(2)]) == 2
    statuses = b.directory.lookup([K(i) for i in range(1, 6)]).statuses
    assert statuses == (HIT, HIT, MISS, HIT, MISS)
    for key in (K(1), K(2)):
        assert b.read(key) == [chunk(key, 0), chunk(key, 1)]
        assert b.directory.slot_of(key) == kept[(K(1), K(2)).index(key)]
    with pytest.raises(IntegrityError):  # adopted by its headers, refused when read
        b.read(K(4))
    log = backing.paths(share_root).log.read_text()
    # Rank 0: K1 K2 K4 K5 valid, K3 invalid; rank 1: K1 K2 K3 K4 valid; 3 adopted.
    assert "recovered 3 chunks, 3 copies ignored" in log
    b.store(K(6))  # it books again
    b.directory.check_integrity()


def _flip(store: DiskStore, slot: int, offset: int) -> None:
    at = store.offset(slot) + offset
    fd = os.open(store.path, os.O_RDWR)
    try:
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0xFF]), at)
    finally:
        os.close(fd)


def test_an_engine_restarts_a_killed_disk_share_itself(
    share_root: Path, backing: DiskBacking, engines: Callable[..., Engine]
) -> None:
    a = engines()
    a.store(K(1))
    a.directory.link.retry_s = 0.0
    kill_node_process(share_root, backing)
    for _ in range(2):  # the connection is found lost, then a node process is started
        assert a.directory.lookup([K(1)]).statuses == (MISS,)  # misses, never an error
    assert a.directory.link.stats["server_starts"] == 1
    assert a.directory.wait_ready(60.0)
    welcome = a.directory.link.welcome
    assert welcome is not None and welcome.generation == 2
    assert welcome.num_slots == SLOTS and welcome.slot_bytes == PAYLOAD  # a disk share again
    a.store(K(2))  # its fence is open (nothing was in flight): recovered, then booked
    assert a.directory.lookup([K(1), K(2)]).statuses == (HIT, HIT)
    assert a.read(K(1)) == [chunk(K(1), 0)]
    spawned = a.directory.link.spawned
    assert spawned is not None
    spawned.close()


def test_recovery_waits_until_no_older_generation_has_a_transfer_in_flight(
    share_root: Path, backing: DiskBacking, engines: Callable[..., Engine]
) -> None:
    a = engines()
    a.store(K(1))
    paths = backing.paths(share_root)
    in_flight = GenerationHold(paths, 1)  # an engine of generation 1 still copying
    assert in_flight.held
    a.close()
    kill_node_process(share_root, backing)
    b = engines()
    assert b.directory.lookup([K(1)]).statuses == (MISS,)  # not recovered yet
    assert b.directory.readable_prefix([K(1)]) == 0
    assert b.directory.try_prepare_load([K(1)]) is None  # loads refused
    assert b.directory.prepare_store([K(2)]).no_room  # stores refused, counted
    counts = b.directory.share_counts()
    assert counts is not None and counts.fenced_stores == 1
    in_flight.release()
    assert b.store(K(2))  # the fence opened: recovered first, then booked
    assert b.directory.lookup([K(1), K(2)]).statuses == (HIT, HIT)
    assert b.read(K(1)) == [chunk(K(1), 0)]


def test_the_serve_loop_recovers_once_the_fence_opens_without_a_call(
    share_root: Path, backing: DiskBacking
) -> None:
    paths = backing.paths(share_root)
    geometry = ShareGeometry(SLOTS, PAYLOAD)
    open_server(paths, geometry, backing).close()  # generation 1 prepared the slabs
    store = DiskStore(backing.root, NS, 0, PAYLOAD, SLOTS, attach=True)
    store.write(3, K(7), memoryview(chunk(K(7), 0)))
    store.close()
    in_flight = GenerationHold(paths, 1)
    server = open_server(paths, None, backing)  # generation 2
    try:
        server.serve_round(0)
        assert server.recovering and server.recovery is None
        assert server.book.directory.lookup([K(7)]).statuses == (MISS,)
        in_flight.release()
        server.serve_round(0)  # no call: the loop looks at the fence by itself
        assert server.recovery == Recovered(adopted=1, ignored=0)
        assert server.book.directory.slot_of(K(7)) == 3
        assert IndexReader(paths).readable_prefix([K(7)]) == 1
    finally:
        server.close()


def test_a_private_engine_and_a_disk_share_never_use_one_namespace(
    share_root: Path, backing: DiskBacking, engines: Callable[..., Engine]
) -> None:
    paths = backing.paths(share_root)
    geometry = ShareGeometry(SLOTS, PAYLOAD)
    private = DiskLock.acquire(backing.root, NS)  # a private engine (this process)
    try:
        refused = f"'disk_path': .* in use by another engine \\(pid {os.getpid()} .*host_share"
        with pytest.raises(ConfigError, match=refused):
            ensure_disk_share(share_root, backing, geometry, 60.0)
        # A node process started anyway refuses too, and says why in its log.
        spawned = spawn_server(paths, geometry, backing)
        assert spawned is not None
        assert spawned.wait_ready(60.0) and spawned.process.wait(60.0) == 2
        assert f"cannot serve: kvoffload config 'disk_path': {backing.root} is in use by " in (
            paths.log.read_text()
        )
        assert not server_alive(paths)
    finally:
        private.release()
    a = engines()  # the namespace is free: the share serves it
    name = backing.share_name()
    with pytest.raises(ConfigError, match=f"node process of disk share {name} .*host_share"):
        DiskLock.acquire(backing.root, NS)
    with pytest.raises(ConfigError, match="disk_path"):
        check_workers_engine(backing.root, NS)  # a private engine's worker
    check_workers_engine(backing.root, NS, share=name)  # a worker of the share's engine
    a.store(K(1))


def test_no_private_engine_takes_the_namespace_while_the_shares_engines_live(
    share_root: Path, backing: DiskBacking, engines: Callable[..., Engine]
) -> None:
    """Its node process died, but the engines may still write into the slabs."""
    a = engines()
    lease = NodeLease(share_of(share_root, backing, ShareGeometry(SLOTS, PAYLOAD)))  # a worker's
    lease.hold(a.directory.session)
    a.store(K(1))
    kill_node_process(share_root, backing)
    engines_live = "'disk_path': .* in use by the engines of a disk share"
    with pytest.raises(ConfigError, match=engines_live):
        DiskLock.acquire(backing.root, NS)
    a.close()
    with pytest.raises(ConfigError, match=engines_live):
        DiskLock.acquire(backing.root, NS)  # the worker still lives
    lease.close()
    DiskLock.acquire(backing.root, NS).release()


def test_a_disk_share_that_cannot_start_says_why(share_root: Path, tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"")  # a disk_path that is not a directory
    backing = DiskBacking(tmp_path / "file", NS)
    with pytest.raises(ConfigError, match="'disk_path': .*file is not a directory"):
        ensure_disk_share(share_root, backing, ShareGeometry(SLOTS, PAYLOAD), 60.0)
    assert not server_alive(backing.paths(share_root))


def test_an_engine_whose_chunks_differ_from_the_share_is_refused(
    share_root: Path, backing: DiskBacking, engines: Callable[..., Engine]
) -> None:
    engines()
    with pytest.raises(ConfigError, match="'disk_path'.*8192 B per rank for 1 rank"):
        open_disk_share_directory(share_root, backing, num_slots=SLOTS, chunk_bytes=4096, ranks=1)
    with pytest.raises(ConfigError, match="'disk_path'.*for 2 rank"):
        engines(ranks=2)
    bigger = engines(num_slots=4 * SLOTS)  # another disk_bytes: the share's geometry wins
    assert bigger.directory.free_slots == SLOTS
    for wrong in ({"payload_bytes": 4096}, {"num_slots": 4 * SLOTS}, {"rank": 1}):
        args = {"rank": 0, "payload_bytes": PAYLOAD, "num_slots": SLOTS} | wrong
        with pytest.raises(ConfigError, match="'disk_path'"):
            DiskStore(backing.root, NS, attach=True, **args)  # type: ignore[arg-type]


def test_attaching_leaves_the_slab_as_it_is(backing: DiskBacking) -> None:
    with pytest.raises(ConfigError, match="'disk_path'.*does not exist"):
        DiskStore(backing.root, NS, 0, PAYLOAD, SLOTS, attach=True)
    DiskStore(backing.root, NS, 0, PAYLOAD, SLOTS).close()
    path = DiskStore(backing.root, NS, 0, PAYLOAD, SLOTS).path
    before = path.read_bytes()
    DiskStore(backing.root, NS, 0, PAYLOAD, SLOTS, attach=True).close()
    assert path.read_bytes() == before


def test_stop_and_remove_keep_the_disk_slabs(
    share_root: Path, backing: DiskBacking, engines: Callable[..., Engine]
) -> None:
    a = engines()
    a.store(K(1))
    a.close()
    paths = backing.paths(share_root)
    backed = ["--disk-root", str(backing.root), "--namespace", NS.hex()]
    with pytest.raises(UsageError, match=f"named {backing.share_name()}, not other"):
        share_main(["serve", "other", *backed, "--root", str(share_root)], DiskBackingOptions())
    assert share_main(["stop", backing.share_name(), "--root", str(share_root)]) == 0
    assert not server_alive(paths)  # stop waits until it exited
    assert share_main(["remove", backing.share_name(), "--root", str(share_root)]) == 0
    assert not paths.dir.exists()
    report = inspect_disk(backing.root, None, verify=True, world_size=1)  # format unchanged
    assert report.stray == 0 and report.bad_total == 0, report
    assert [ns.complete_chunks for ns in report.namespaces] == [1]
    tier, recovery = open_disk_tier(backing.root, NS, 1, SLOTS, PAYLOAD)  # a private engine
    assert recovery.adopted == 1 and tier.directory.lookup([K(1)]).statuses == (HIT,)
    DiskLock.acquire(backing.root, NS).release()  # the namespace is free again
