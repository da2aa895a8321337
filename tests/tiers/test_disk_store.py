"""The disk tier's files: format, permissions, torn writes, corruption, recovery."""

from __future__ import annotations

import errno
import mmap
import os
import stat
from pathlib import Path

import pytest

from kvoffload.core.chunk_format import IntegrityError, IntegrityReason
from kvoffload.core.keys import ChunkKey
from kvoffload.tiers import disk as disk_module
from kvoffload.tiers.disk import PAYLOAD_OFFSET, DiskStore, scan, sweep
from kvoffload.tiers.disk_index import open_disk_tier
from kvoffload.tiers.disk_store import DiskTierStore

DIGEST = bytes(range(16))
PAYLOAD = 8192


def K(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def data(i: int) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(PAYLOAD))


@pytest.mark.parametrize("o_direct", [False, True])
def test_round_trip_and_owner_only_permissions(tmp_path: Path, o_direct: bool) -> None:
    store = DiskStore(tmp_path, DIGEST, rank=0, payload_bytes=PAYLOAD, o_direct=o_direct)
    store.write(K(1), memoryview(data(1)))
    out = bytearray(PAYLOAD)
    store.read_into(K(1), memoryview(out))
    assert bytes(out) == data(1)
    path = store.path(K(1))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for parent in (path.parent, path.parent.parent, path.parent.parent.parent):
        assert stat.S_IMODE(parent.stat().st_mode) == 0o700


@pytest.mark.parametrize("payload", [PAYLOAD, PAYLOAD - 100])
@pytest.mark.parametrize("aligned", [True, False])
def test_o_direct_moves_aligned_buffers_in_place_and_others_through_a_bounce(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, payload: int, aligned: bool
) -> None:
    store = DiskStore(tmp_path, DIGEST, 0, payload, o_direct=True)
    source = memoryview(mmap.mmap(-1, payload + (0 if aligned else 1)))[(0 if aligned else 1) :]
    source[:] = data(3)[:payload]
    bounced: list[int] = []
    real = DiskStore._bounce
    monkeypatch.setattr(DiskStore, "_bounce", lambda self: bounced.append(1) or real(self))
    store.write(K(3), source)
    out = memoryview(mmap.mmap(-1, payload))
    store.read_into(K(3), out)
    assert bytes(out) == data(3)[:payload]
    raw = store.path(K(3)).read_bytes()
    assert len(raw) == PAYLOAD_OFFSET + -(-payload // 4096) * 4096  # page-padded
    assert raw[PAYLOAD_OFFSET : PAYLOAD_OFFSET + payload] == data(3)[:payload]
    if store.o_direct:  # the filesystem took O_DIRECT (tmpfs would not)
        whole_pages = payload % 4096 == 0
        expected = int(not (aligned and whole_pages)) + int(not whole_pages)  # write + read
        assert len(bounced) == expected


def test_a_write_that_dies_before_the_rename_leaves_nothing_readable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = DiskStore(tmp_path, DIGEST, 0, PAYLOAD)

    def crash(src: object, dst: object) -> None:
        raise KeyboardInterrupt("power cut")

    monkeypatch.setattr(disk_module.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        store.write(K(2), memoryview(data(2)))
    monkeypatch.undo()
    assert not store.path(K(2)).exists()
    with pytest.raises(FileNotFoundError):
        store.read_into(K(2), memoryview(bytearray(PAYLOAD)))
    assert list(scan(tmp_path, DIGEST)) == []


def test_a_stale_temporary_file_is_swept(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, DIGEST, 0, PAYLOAD)
    store.write(K(3), memoryview(data(3)))
    stale = store.path(K(3)).with_name(store.path(K(3)).name + ".tmp.99999.0")
    stale.write_bytes(b"half a chunk")
    assert sweep(tmp_path, DIGEST) == 1 and not stale.exists()
    assert [f.key for f in scan(tmp_path, DIGEST)] == [K(3)]


FLIP = PAYLOAD_OFFSET + 500  # a payload byte


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda p: p.write_bytes(p.read_bytes()[:-100]), IntegrityReason.SIZE),
        (lambda p: p.write_bytes(p.read_bytes()[:30]), IntegrityReason.SIZE),
        (lambda p: p.write_bytes(p.read_bytes() + b"x"), IntegrityReason.SIZE),
        (
            lambda p: p.write_bytes(
                p.read_bytes()[:FLIP]
                + bytes([p.read_bytes()[FLIP] ^ 0xFF])
                + p.read_bytes()[FLIP + 1 :]
            ),
            IntegrityReason.CHECKSUM,
        ),
        (lambda p: p.write_bytes(os.urandom(64 + PAYLOAD)), IntegrityReason.MAGIC),
    ],
)
def test_truncated_or_flipped_files_are_rejected(tmp_path: Path, damage, reason) -> None:  # type: ignore[no-untyped-def]
    store = DiskStore(tmp_path, DIGEST, 0, PAYLOAD)
    store.write(K(4), memoryview(data(4)))
    damage(store.path(K(4)))
    with pytest.raises(IntegrityError) as info:
        store.read_into(K(4), memoryview(bytearray(PAYLOAD)))
    assert info.value.reason is reason
    failures = DiskTierStore(store).read_many([K(4)], [memoryview(bytearray(PAYLOAD))])
    assert failures == [f"integrity:{reason.value}"]
    assert not store.path(K(4)).exists()  # the bad copy is deleted where it was found


def test_another_rank_namespace_or_key_never_verifies(tmp_path: Path) -> None:
    rank0 = DiskStore(tmp_path, DIGEST, 0, PAYLOAD)
    rank1 = DiskStore(tmp_path, DIGEST, 1, PAYLOAD)
    rank0.write(K(5), memoryview(data(5)))
    os.replace(rank0.path(K(5)), rank1.path(K(5)))  # a file under another rank's name
    with pytest.raises(IntegrityError) as info:
        rank1.read_into(K(5), memoryview(bytearray(PAYLOAD)))
    assert info.value.reason is IntegrityReason.KEY
    other = DiskStore(tmp_path, bytes(16), 0, PAYLOAD)
    rank0.write(K(6), memoryview(data(6)))
    other.path(K(6)).parent.mkdir(parents=True, exist_ok=True)
    os.replace(rank0.path(K(6)), other.path(K(6)))
    with pytest.raises(IntegrityError) as info:
        other.read_into(K(6), memoryview(bytearray(PAYLOAD)))
    assert info.value.reason is IntegrityReason.FORMAT


def test_disk_full_is_a_per_chunk_failure_and_leaves_no_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = DiskStore(tmp_path, DIGEST, 0, PAYLOAD)
    tier = DiskTierStore(store)

    def full(fd: int, buffers: object) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(disk_module.os, "writev", full)
    failures = tier.write_many([(K(7), memoryview(data(7))), (K(8), memoryview(data(8)))])
    assert failures == ["io:No space left on device"] * 2
    monkeypatch.undo()
    assert list(store.dir.rglob("*")) == [p for p in store.dir.rglob("*") if p.is_dir()]
    assert tier.write_many([(K(7), memoryview(data(7)))]) == [None]


def test_restart_recovery_rebuilds_the_directory_from_complete_chunks(tmp_path: Path) -> None:
    ranks = [DiskStore(tmp_path, DIGEST, r, PAYLOAD) for r in (0, 1)]
    for i in range(5):
        for store in ranks:
            store.write(K(i), memoryview(data(i)))
    ranks[0].write(K(9), memoryview(data(9)))  # rank 1's share never written
    stale = ranks[0].path(K(0)).with_name("x.tmp.1.1")
    stale.write_bytes(b"torn")
    tier, removed = open_disk_tier(tmp_path, DIGEST, world_size=2, num_slots=3)
    assert removed == 1 + 1 + 2 * 2  # the temp file, K(9)'s lone share, 2 surplus chunks
    assert len(tier.directory) == 3
    assert tier.present_run([K(2), K(3), K(4)]) == 3
    assert tier.present_run([K(9)]) == 0 and tier.present_run([K(0)]) == 0
    assert not ranks[0].path(K(9)).exists() and not stale.exists()
    tier.directory.check_integrity()
