"""The disk tier's slab: format, permissions, O_DIRECT, torn writes, corruption,
a full disk, restart recovery."""

from __future__ import annotations

import errno
import mmap
import os
import stat
from pathlib import Path

import pytest

from kvoffload.core.chunk_format import IntegrityError, IntegrityReason
from kvoffload.core.errors import ConfigError
from kvoffload.core.failures import integrity_failure, io_failure
from kvoffload.core.keys import ChunkKey
from kvoffload.tiers import disk as disk_module
from kvoffload.tiers.disk import PAYLOAD_OFFSET, DiskStore, slab_bytes
from kvoffload.tiers.disk_index import open_disk_tier
from kvoffload.tiers.disk_store import DiskTierStore
from kvoffload.tiers.slab_format import SUPERBLOCK_BYTES, Superblock

DIGEST = bytes(range(16))
PAYLOAD = 8192
SLOTS = 8


def K(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def data(i: int) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(PAYLOAD))


def store(root: Path, rank: int = 0, **kw: object) -> DiskStore:
    return DiskStore(root, DIGEST, rank, PAYLOAD, SLOTS, **kw)  # type: ignore[arg-type]


def read(s: DiskStore, slot: int, key: ChunkKey) -> bytes:
    out = bytearray(s.payload_bytes)
    s.read_into(slot, key, memoryview(out))
    return bytes(out)


def patch_slot(s: DiskStore, slot: int, offset: int, new: bytes) -> None:
    with open(s.path, "r+b") as f:
        f.seek(s.offset(slot) + offset)
        f.write(new)


@pytest.mark.parametrize("o_direct", [False, True])
def test_round_trip_preallocation_and_owner_only_permissions(
    tmp_path: Path, o_direct: bool
) -> None:
    s = store(tmp_path, o_direct=o_direct)
    s.write(3, K(1), memoryview(data(1)))
    assert read(s, 3, K(1)) == data(1)
    assert s.path.stat().st_size == slab_bytes(PAYLOAD, SLOTS)
    assert s.path.stat().st_blocks * 512 >= slab_bytes(PAYLOAD, SLOTS)  # reserved up front
    assert stat.S_IMODE(s.path.stat().st_mode) == 0o600
    for parent in (s.path.parent, s.path.parent.parent):
        assert stat.S_IMODE(parent.stat().st_mode) == 0o700
    block = Superblock.decode(s.path.read_bytes()[:SUPERBLOCK_BYTES])
    assert (block.namespace_digest, block.rank, block.payload_bytes, block.num_slots) == (
        DIGEST, 0, PAYLOAD, SLOTS,
    )  # fmt: skip
    s.close()


@pytest.mark.parametrize("payload", [PAYLOAD, PAYLOAD - 100])
@pytest.mark.parametrize("aligned", [True, False])
def test_o_direct_moves_aligned_buffers_in_place_and_others_through_a_bounce(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, payload: int, aligned: bool
) -> None:
    s = DiskStore(tmp_path, DIGEST, 0, payload, SLOTS, o_direct=True)
    source = memoryview(mmap.mmap(-1, payload + (0 if aligned else 1)))[(0 if aligned else 1) :]
    source[:] = data(3)[:payload]
    bounced: list[int] = []
    real = DiskStore._bounce
    monkeypatch.setattr(DiskStore, "_bounce", lambda self: bounced.append(1) or real(self))
    s.write(5, K(3), source)
    out = memoryview(mmap.mmap(-1, payload))
    s.read_into(5, K(3), out)
    assert bytes(out) == data(3)[:payload]
    raw = s.path.read_bytes()[s.offset(5) :]
    assert raw[PAYLOAD_OFFSET : PAYLOAD_OFFSET + payload] == data(3)[:payload]
    assert not any(raw[PAYLOAD_OFFSET + payload : s.slot_bytes])  # zero padding
    if s.o_direct:  # the filesystem took O_DIRECT (tmpfs would not)
        whole_pages = payload % 4096 == 0
        expected = int(not (aligned and whole_pages)) + int(not whole_pages)  # write + read
        assert len(bounced) == expected


FLIP = PAYLOAD_OFFSET + 500  # a payload byte


@pytest.mark.parametrize(
    ("offset", "new", "reason"),
    [
        (FLIP, b"\xff", IntegrityReason.CHECKSUM),
        (0, b"XXXX", IntegrityReason.MAGIC),
        (4, b"\x09\x00", IntegrityReason.VERSION),
        (8, b"\x01\x00", IntegrityReason.LENGTH),
        (20, b"\x00", IntegrityReason.FORMAT),
        (40, b"\x00", IntegrityReason.KEY),
        (70, b"\x01", IntegrityReason.KEY),  # the chunk key after the header
    ],
)
def test_a_damaged_slot_is_rejected_by_reason_and_cleared(
    tmp_path: Path, offset: int, new: bytes, reason: IntegrityReason
) -> None:
    s = store(tmp_path)
    s.write(2, K(4), memoryview(data(4)))
    patch_slot(s, 2, offset, new)
    with pytest.raises(IntegrityError) as info:
        read(s, 2, K(4))
    assert info.value.reason is reason
    tier = DiskTierStore(s)
    failures = tier.read_many([K(4)], [2], [memoryview(bytearray(PAYLOAD))])
    assert failures == [integrity_failure(reason.value)]
    with pytest.raises(IntegrityError) as info:  # cleared where it was found
        read(s, 2, K(4))
    assert info.value.reason is IntegrityReason.MAGIC


def test_a_torn_write_is_never_read_as_valid(tmp_path: Path) -> None:
    """A crash between the header and the end of the payload: either the new header
    with part of the new payload, or the old header with part of it."""
    s = store(tmp_path)
    s.write(1, K(1), memoryview(data(1)))
    old_slot = s.path.read_bytes()[s.offset(1) : s.offset(1) + s.slot_bytes]
    s.write(1, K(2), memoryview(data(2)))
    new_slot = s.path.read_bytes()[s.offset(1) : s.offset(1) + s.slot_bytes]
    cut = PAYLOAD_OFFSET + PAYLOAD // 2
    for torn, key in (
        (new_slot[:cut] + old_slot[cut:], K(2)),
        (old_slot[:cut] + new_slot[cut:], K(1)),
    ):
        patch_slot(s, 1, 0, torn)
        with pytest.raises(IntegrityError) as info:
            read(s, 1, key)
        assert info.value.reason is IntegrityReason.CHECKSUM


def test_a_short_slab_is_a_size_miss(tmp_path: Path) -> None:
    s = store(tmp_path)
    s.write(SLOTS - 1, K(5), memoryview(data(5)))
    os.truncate(s.path, s.offset(SLOTS - 1) + PAYLOAD_OFFSET + 100)
    with pytest.raises(IntegrityError) as info:
        read(s, SLOTS - 1, K(5))
    assert info.value.reason is IntegrityReason.SIZE


def test_another_rank_or_namespace_never_verifies(tmp_path: Path) -> None:
    rank0, rank1 = store(tmp_path, 0), store(tmp_path, 1)
    rank0.write(0, K(5), memoryview(data(5)))
    patch_slot(rank1, 0, 0, rank0.path.read_bytes()[rank0.offset(0) : rank0.offset(1)])
    with pytest.raises(IntegrityError) as info:
        read(rank1, 0, K(5))
    assert info.value.reason is IntegrityReason.KEY
    other = DiskStore(tmp_path, bytes(16), 0, PAYLOAD, SLOTS)
    patch_slot(other, 0, 0, rank0.path.read_bytes()[rank0.offset(0) : rank0.offset(1)])
    with pytest.raises(IntegrityError) as info:
        read(other, 0, K(5))
    assert info.value.reason is IntegrityReason.FORMAT


def test_a_full_disk_fails_at_start_or_per_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_space(*args: object) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(disk_module.os, "posix_fallocate", no_space)
    with pytest.raises(ConfigError, match="disk_bytes.*disk full"):
        store(tmp_path)
    monkeypatch.undo()
    s = store(tmp_path)
    tier = DiskTierStore(s)
    monkeypatch.setattr(disk_module.os, "pwritev", no_space)  # e.g. a sparse file, thin disk
    items = [(K(7), memoryview(data(7))), (K(8), memoryview(data(8)))]
    assert tier.write_many(items, [0, 1]) == [io_failure("No space left on device")] * 2
    monkeypatch.undo()
    assert tier.write_many(items[:1], [0]) == [None]


def test_restart_recovery_adopts_complete_newest_chunks(tmp_path: Path) -> None:
    ranks = [store(tmp_path, r) for r in (0, 1)]
    for i in range(5):
        for s in ranks:
            s.write(i, K(i), memoryview(data(i)))
    ranks[0].write(5, K(9), memoryview(data(9)))  # rank 1's share never written
    for s in ranks:  # K(1) written again elsewhere: the copy in slot 1 is older
        s.write(6, K(1), memoryview(data(1)))
    patch_slot(ranks[1], 2, 0, b"junk")  # rank 1's header of K(2) destroyed
    tier, recovery = open_disk_tier(tmp_path, DIGEST, 2, SLOTS, PAYLOAD)
    assert recovery.adopted == 4  # K(0), K(1) (slot 6), K(3), K(4)
    assert recovery.ignored == 1 + 2 + 2  # K(9)'s lone share, K(1)'s old pair, both of K(2)
    d = tier.directory
    assert [tier.present_run([K(i)]) for i in range(5)] == [1, 1, 0, 1, 1]
    assert tier.book_promotion([K(1)]) == (6,)
    d.complete_load([K(1)])
    # Least recently written first: K(0) is the first victim, K(1) (rewritten) the last.
    prepared = d.prepare_store([K(20 + i) for i in range(SLOTS - 4 + 1)])
    assert prepared.evicted == (K(0),)
    d.check_integrity()


def test_recovery_ignores_a_slab_of_another_geometry(tmp_path: Path) -> None:
    s = store(tmp_path)
    s.write(0, K(1), memoryview(data(1)))
    s.close()
    bigger = DiskStore(tmp_path, DIGEST, 0, 2 * PAYLOAD, SLOTS)  # another chunk size
    bigger.close()
    tier, recovery = open_disk_tier(tmp_path, DIGEST, 1, SLOTS, PAYLOAD)
    assert recovery.adopted == 0 and len(tier.directory) == 0
    assert open_disk_tier(tmp_path, DIGEST, 1, SLOTS, 2 * PAYLOAD)[1].adopted == 0


def test_a_smaller_capacity_drops_the_slots_past_it(tmp_path: Path) -> None:
    s = store(tmp_path)
    s.write(1, K(1), memoryview(data(1)))
    s.write(SLOTS - 1, K(2), memoryview(data(2)))
    s.close()
    smaller = DiskStore(tmp_path, DIGEST, 0, PAYLOAD, 4)
    assert smaller.path.stat().st_size == slab_bytes(PAYLOAD, 4)
    tier, recovery = open_disk_tier(tmp_path, DIGEST, 1, 4, PAYLOAD)
    assert recovery.adopted == 1 and tier.present_run([K(1)]) == 1
    assert read(smaller, 1, K(1)) == data(1)
