"""``kvoffload inspect disk`` over slab files: counts, bytes and capacity, chunks as
start-up recovery counts them, verification by reason (and in agreement with the disk
tier's reader), bad and stray files, read-only, one-line usage errors."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvoffload import cli
from kvoffload.core.chunk_format import IntegrityError
from kvoffload.core.errors import UsageError
from kvoffload.core.keys import ChunkKey
from kvoffload.inspect_command import main
from kvoffload.inspection.checks import SLOT_HEAD_BYTES
from kvoffload.inspection.disk_scan import parse_slab_name
from kvoffload.tiers.disk import PAYLOAD_OFFSET, DiskStore, namespace_dir, slot_bytes
from kvoffload.tiers.disk_index import open_disk_tier
from kvoffload.tiers.slab_format import SUPERBLOCK_BYTES

NS_A = bytes(range(16))
NS_B = bytes(range(16, 32))
NS_C = bytes(range(32, 48))
PAYLOAD = 8192
SLOTS = 4
SLOT = slot_bytes(PAYLOAD)  # 12 KiB: the header block and the payload


def K(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def data(i: int, size: int = PAYLOAD) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(size))


def slot_offset(slot: int, stride: int = SLOT) -> int:
    return SUPERBLOCK_BYTES + slot * stride


def patch(path: Path, offset: int, change: Callable[[bytes], bytes], size: int = 1) -> None:
    """Rewrite ``size`` bytes of ``path`` at ``offset`` (the damage under test)."""
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, change(os.pread(fd, size, offset)), offset)
    finally:
        os.close(fd)


def flip(b: bytes) -> bytes:
    return bytes([b[0] ^ 1]) + b[1:]


@dataclass
class Damage:
    ns: bytes
    rank: int
    slot: int
    key: ChunkKey
    reason: str


@dataclass
class Tree:
    root: Path
    stores: dict[tuple[bytes, int], DiskStore]
    damaged: list[Damage] = field(default_factory=list)

    def name(self, ns: bytes, rank: int, slot: int | None = None) -> str:
        name = f"kvoffload-v1/{ns.hex()}/slab.r{rank}"
        return name if slot is None else f"{name} slot {slot}"


def build_tree(root: Path) -> Tree:
    """Namespaces A and B, ranks 0 and 1, 4 slots of 8 KiB payloads; chunks 1..3 in
    slots 0..2 on both ranks. A: chunk 4 in slot 3 on rank 0 only; rank 1's slot 1
    with a header of format version 2. B: rank 0's slot 2 with a payload byte flipped;
    rank 1's slab cut off 100 bytes into slot 1's payload. C: a zero-length slab.r0, a
    garbage slab.r1 and, as slab.r2, a copy of A's slab.r0. Stray: a README beside the
    namespaces, a slab.r01, notes.txt and a fan-out directory of the former layout."""
    stores = {
        (ns, rank): DiskStore(root, ns, rank, PAYLOAD, SLOTS)
        for ns in (NS_A, NS_B)
        for rank in (0, 1)
    }
    tree = Tree(root, stores)
    for store in stores.values():
        for i in (1, 2, 3):
            store.write(i - 1, K(i), memoryview(data(i)))
    stores[NS_A, 0].write(3, K(4), memoryview(data(4)))
    patch(stores[NS_A, 1].path, slot_offset(1) + 4, lambda _: b"\x02\x00", 2)
    tree.damaged.append(Damage(NS_A, 1, 1, K(2), "version"))
    patch(stores[NS_B, 0].path, slot_offset(2) + PAYLOAD_OFFSET + 500, flip)
    tree.damaged.append(Damage(NS_B, 0, 2, K(3), "checksum"))
    os.truncate(stores[NS_B, 1].path, slot_offset(1) + PAYLOAD_OFFSET + 100)
    tree.damaged.append(Damage(NS_B, 1, 1, K(2), "size"))
    c = namespace_dir(root, NS_C)
    c.mkdir(mode=0o700)
    (c / "slab.r0").write_bytes(b"")
    (c / "slab.r1").write_bytes(b"\xa5" * 4096)
    shutil.copyfile(stores[NS_A, 0].path, c / "slab.r2")
    (root / "kvoffload-v1" / "README").write_text("x")
    a = namespace_dir(root, NS_A)
    shutil.copyfile(stores[NS_A, 0].path, a / "slab.r01")
    (a / "notes.txt").write_text("x")
    (a / "00").mkdir()
    return tree


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[Tree]:
    built = build_tree(tmp_path)
    try:
        yield built
    finally:
        for store in built.stores.values():
            store.close()


def listing(root: Path) -> dict[str, tuple[int, int, int, str]]:
    """Every entry under ``root``: mode, size, mtime (ns) and content digest."""
    out = {}
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
        out[str(path.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns, digest)
    return out


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    status = main([*argv, "--json"])
    return status, json.loads(capsys.readouterr().out)


def by_ns(doc: dict[str, Any]) -> dict[str, Any]:
    return {ns["namespace"]: ns for ns in doc["namespaces"]}


def reader_verdict(store: DiskStore, slot: int, key: ChunkKey) -> str | None:
    """What the disk tier's reader makes of ``slot`` read as ``key``'s chunk."""
    try:
        store.read_into(slot, key, memoryview(bytearray(store.payload_bytes)))
    except IntegrityError as exc:
        return exc.reason.value
    return None


def test_counts_bytes_capacity_and_bad_slabs_without_verify(
    tree: Tree, capsys: pytest.CaptureFixture[str]
) -> None:
    status, doc = run_json(["disk", str(tree.root)], capsys)
    assert status == 0
    ns = by_ns(doc)
    assert list(ns) == [NS_A.hex(), NS_B.hex(), NS_C.hex()]
    a, b, c = ns[NS_A.hex()], ns[NS_B.hex()], ns[NS_C.hex()]
    # A: chunks 1 and 3 complete; 2 (rank 1's header is bad) and 4 (rank 0 only) not
    assert (a["complete_chunks"], a["incomplete_chunks"], a["world_size"]) == (2, 2, 2)
    assert a["shares_per_rank"] == {"0": 4, "1": 3} and a["shares"] == 7
    assert a["slots_per_rank"] == {"0": SLOTS, "1": SLOTS}
    assert (a["bytes"], a["capacity_bytes"]) == (7 * SLOT, 2 * SLOTS * SLOT)
    assert a["format_versions"] == {"1": 6, "2": 1}
    assert a["payload_bytes"] == {str(PAYLOAD): 2}
    assert (a["duplicate_slots"], a["bad_slabs"], a["vanished"]) == (0, [], 0)
    # B: headers only, so chunk 3 (payload damaged on rank 0, gone on rank 1) is
    # incomplete only because rank 1's slab ends in slot 1
    assert (b["complete_chunks"], b["incomplete_chunks"]) == (2, 1)
    assert b["shares_per_rank"] == {"0": 3, "1": 2}
    assert (b["bytes"], b["capacity_bytes"]) == (5 * SLOT, 2 * SLOTS * SLOT)
    cut = slot_offset(1) + PAYLOAD_OFFSET + 100
    assert b["bad_slabs"] == [
        {
            "name": tree.name(NS_B, 1),
            "rank": 1,
            "reason": "short",
            "detail": f"short: {cut} of {slot_offset(SLOTS)} bytes, slots 1..3 cut off",
        }
    ]
    assert [(s["name"], s["reason"]) for s in c["bad_slabs"]] == [
        (tree.name(NS_C, 0), "superblock"),
        (tree.name(NS_C, 1), "superblock"),
        (tree.name(NS_C, 2), "foreign"),
    ]
    assert "0 bytes" in c["bad_slabs"][0]["detail"]
    assert "bad magic" in c["bad_slabs"][1]["detail"]
    assert f"names namespace {NS_A.hex()} rank 0" in c["bad_slabs"][2]["detail"]
    assert (c["world_size"], c["complete_chunks"], c["shares"], c["capacity_bytes"]) == (3, 0, 0, 0)
    # one KV cache group: every chunk is group 0
    assert (a["chunks_per_group"], b["chunks_per_group"]) == ({"0": 2}, {"0": 2})
    assert c["chunks_per_group"] == {"0": 0}
    assert c["slots_per_rank"] == {} and c["payload_bytes"] == {}
    assert doc["stray"] == 4
    assert doc["stray_examples"] == [
        f"kvoffload-v1/{NS_A.hex()}/00",
        f"kvoffload-v1/{NS_A.hex()}/notes.txt",
        f"kvoffload-v1/{NS_A.hex()}/slab.r01",
        "kvoffload-v1/README",
    ]
    assert "ok" not in a and doc["bad_total"] == 0 and doc["warnings"] == []
    assert "temporary_files" not in a  # the slab layout has no temporary files


def test_complete_chunks_are_what_recovery_adopts(tree: Tree) -> None:
    """The counts are the ones the engine would recover at start (same geometry)."""
    for digest, complete in ((NS_A, 2), (NS_B, 2)):
        _, recovery = open_disk_tier(tree.root, digest, 2, SLOTS, PAYLOAD)
        assert recovery.adopted == complete


def test_verify_names_bad_slots_by_reason_agrees_with_the_reader_and_changes_nothing(
    tree: Tree, capsys: pytest.CaptureFixture[str]
) -> None:
    before = listing(tree.root)
    status, doc = run_json(["disk", str(tree.root), "--verify"], capsys)
    assert status == 1
    a, b, c = (by_ns(doc)[ns.hex()] for ns in (NS_A, NS_B, NS_C))
    assert (a["ok"], a["bad"]) == (6, {"version": 1})
    assert (b["ok"], b["bad"]) == (3, {"checksum": 1, "size": 1})
    assert (c["ok"], c["bad"]) == (0, {})
    assert doc["bad_total"] == 3 + 4  # bad slots, and the bad slab files when verifying
    found = {e["name"]: e for ns in (a, b) for e in ns["bad_examples"]}
    assert set(found) == {tree.name(d.ns, d.rank, d.slot) for d in tree.damaged}
    assert found[tree.name(NS_B, 1, 1)]["detail"] == (
        f"stored chunk rejected (size): 100 of {PAYLOAD} bytes"
    )
    # the reader agrees on every damaged slot, and accepts every slot found good
    for d in tree.damaged:
        assert found[tree.name(d.ns, d.rank, d.slot)]["reason"] == d.reason
        assert reader_verdict(tree.stores[d.ns, d.rank], d.slot, d.key) == d.reason
    damaged = {(d.ns, d.rank, d.slot) for d in tree.damaged}
    good = [
        (ns, rank, slot)
        for ns in (NS_A, NS_B)
        for rank in (0, 1)
        for slot in range(3)
        if (ns, rank, slot) not in damaged and (ns, rank, slot) != (NS_B, 1, 2)
    ]
    assert len(good) + 1 == a["ok"] + b["ok"]  # + A's chunk 4
    for ns, rank, slot in [*good, (NS_A, 0, 3)]:
        assert reader_verdict(tree.stores[ns, rank], slot, K(slot + 1)) is None
    assert main(["disk", str(tree.root), "--verify"]) == 1  # the table, too
    text = capsys.readouterr().out
    assert f"  bad: {tree.name(NS_A, 1, 1)}: stored chunk rejected (version): version 2\n" in text
    assert f"bad slab: {tree.name(NS_C, 2)}: the superblock names namespace" in text
    assert "result: 3 of 12 slots bad, 4 slab files bad\n" in text
    assert listing(tree.root) == before


def test_the_text_table(tree: Tree, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["disk", str(tree.root)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"disk tier at {tree.root} (read-only)"
    head = lines[2].split()
    assert head == ["NAMESPACE", "CHUNKS", "INCOMPLETE", "USED", "SLOTS", "PER", "RANK"] + [
        "USED",
        "CAPACITY",
        "PAYLOAD",
        "VERSION",
    ]
    rows = {line.split()[0]: line.split() for line in lines[3:7]}
    assert rows[NS_A.hex()][1:] == [
        "2", "2", "r0=4/4", "r1=3/4", "84.0", "KiB", "96.0", "KiB", "8.0", "KiB", "1:6", "2:1"
    ]  # fmt: skip
    assert rows[NS_C.hex()][1:] == ["0", "0", "r0=bad", "r1=bad", "r2=bad", "0", "B", "0", "B"] + [
        "-",
        "-",
    ]
    assert rows["total"][1:] == ["4", "3", "12/16", "144.0", "KiB", "192.0", "KiB"]
    assert f"note: 4 stray names that are not slab files: kvoffload-v1/{NS_A.hex()}/00," in (
        "\n".join(lines)
    )
    assert not any(line.startswith("result:") for line in lines)  # only with --verify


def test_a_clean_tree_verifies_with_status_0_and_cleared_slots_are_empty(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    size = PAYLOAD + 100  # not a page multiple: every slot has padding
    stores = [DiskStore(tmp_path, NS_A, rank, size, SLOTS, o_direct=rank == 1) for rank in (0, 1)]
    try:
        for store in stores:
            store.write(0, K(1), memoryview(data(1, size)))
            store.write(2, K(2), memoryview(data(2, size)))
            store.clear(2)  # a bad copy the engine cleared
        status, doc = run_json(["disk", str(tmp_path), "--verify"], capsys)
        assert status == 0
        ns = by_ns(doc)[NS_A.hex()]
        assert (ns["ok"], ns["bad"], ns["shares_per_rank"]) == (2, {}, {"0": 1, "1": 1})
        assert (ns["complete_chunks"], ns["incomplete_chunks"]) == (1, 0)
        assert ns["bytes"] == 2 * slot_bytes(size) and ns["payload_bytes"] == {str(size): 2}
        assert doc["bad_total"] == 0
        assert main(["disk", str(tmp_path), "--verify"]) == 0
        assert "result: all slots verified OK" in capsys.readouterr().out
    finally:
        for store in stores:
            store.close()


def test_chunks_are_counted_per_kv_cache_group(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A layout of two KV cache groups: complete chunks by the group their headers
    name (rank 0's lone chunk 4 is incomplete and not counted); every slot verifies,
    and the reader takes each back only as its own group. The table gets a column."""
    stores = [DiskStore(tmp_path, NS_A, rank, PAYLOAD, SLOTS, groups=2) for rank in (0, 1)]
    try:
        for store in stores:
            for slot, (i, group) in enumerate(((1, 0), (2, 1), (3, 1))):
                store.write(slot, K(i), memoryview(data(i)), group)
        stores[0].write(3, K(4), memoryview(data(4)), 1)
        status, doc = run_json(["disk", str(tmp_path), "--verify"], capsys)
        assert status == 0
        ns = by_ns(doc)[NS_A.hex()]
        assert (ns["complete_chunks"], ns["incomplete_chunks"]) == (3, 1)
        assert ns["chunks_per_group"] == {"0": 1, "1": 2}
        assert (ns["ok"], ns["bad"]) == (7, {})
        assert reader_verdict(stores[1], 1, K(2)) == "group"  # read as group 0
        out = memoryview(bytearray(PAYLOAD))
        stores[1].read_into(1, K(2), out, group=1)
        assert bytes(out) == data(2)
        assert main(["disk", str(tmp_path)]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert " ".join(lines[2].split()[:6]) == "NAMESPACE CHUNKS INCOMPLETE CHUNKS PER GROUP"
        assert lines[3].split()[:5] == [NS_A.hex(), "3", "1", "g0=1", "g1=2"]
    finally:
        for store in stores:
            store.close()
    _, recovery = open_disk_tier(tmp_path, NS_A, 2, SLOTS, PAYLOAD)
    assert recovery.adopted == 3  # what the engine adopts at start: every group's chunks


def test_a_slab_cut_in_an_empty_slot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What is left of an empty slot's header block is still empty (not a used slot),
    and the slab is reported short."""
    store = DiskStore(tmp_path, NS_A, 0, PAYLOAD, 3)
    store.write(0, K(1), memoryview(data(1)))
    store.close()
    os.truncate(store.path, slot_offset(1) + 40)
    status, doc = run_json(["disk", str(tmp_path), "--verify"], capsys)
    ns = by_ns(doc)[NS_A.hex()]
    assert (ns["shares_per_rank"], ns["ok"], ns["complete_chunks"]) == ({"0": 1}, 1, 1)
    assert [(s["reason"], s["detail"].split(",")[1]) for s in ns["bad_slabs"]] == [
        ("short", " slots 1..2 cut off")
    ]
    assert status == 1 and doc["bad_total"] == 1
    _, recovery = open_disk_tier(tmp_path, NS_A, 1, 3, PAYLOAD)
    assert recovery.adopted == 1


def test_duplicates_torn_overwrites_and_world_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Slot 0: chunk 1; slot 1: chunk 2; slot 2: chunk 1 again (an older copy); slot 3:
    chunk 5 on rank 0 over chunk 2 still on rank 1 (a crash between the ranks'
    writes); slot 4: chunk 6 on rank 0 and, on rank 1, rank 0's copy of it."""
    r0, r1 = (DiskStore(tmp_path, NS_A, rank, PAYLOAD, 6) for rank in (0, 1))
    try:
        for slot, i0, i1 in ((0, 1, 1), (1, 2, 2), (2, 1, 1), (3, 5, 2), (4, 6, 6)):
            r0.write(slot, K(i0), memoryview(data(i0)))
            r1.write(slot, K(i1), memoryview(data(i1)))
        with open(r0.path, "rb") as src:
            src.seek(slot_offset(4))
            copy = src.read(SLOT)
        patch(r1.path, slot_offset(4), lambda _: copy, SLOT)
        _, recovery = open_disk_tier(tmp_path, NS_A, 2, 6, PAYLOAD)
        status, doc = run_json(["disk", str(tmp_path), "--verify"], capsys)
        ns = by_ns(doc)[NS_A.hex()]
        assert (ns["complete_chunks"], ns["incomplete_chunks"]) == (2, 2)  # {1, 2}, {5, 6}
        assert ns["complete_chunks"] == recovery.adopted
        assert ns["duplicate_slots"] == 1
        assert (status, ns["bad"], ns["ok"]) == (1, {"key": 1}, 9)
        assert ns["bad_examples"][0]["name"] == f"kvoffload-v1/{NS_A.hex()}/slab.r1 slot 4"
        assert reader_verdict(r1, 4, K(6)) == "key"
        _, doc = run_json(["disk", str(tmp_path), "--world-size", "1"], capsys)
        ns = by_ns(doc)[NS_A.hex()]
        assert (ns["complete_chunks"], ns["incomplete_chunks"], ns["duplicate_slots"]) == (4, 0, 1)
        _, doc = run_json(["disk", str(tmp_path), "--world-size", "3"], capsys)
        ns = by_ns(doc)[NS_A.hex()]  # no rank 2: nothing is complete
        assert (ns["complete_chunks"], ns["incomplete_chunks"], ns["world_size"]) == (0, 4, 3)
        assert main(["disk", str(tmp_path)]) == 0
        assert f"note: {NS_A.hex()}: 1 complete slots hold a chunk" in capsys.readouterr().out
    finally:
        r0.close()
        r1.close()


def test_slabs_of_different_geometry_complete_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stores = [DiskStore(tmp_path, NS_A, 0, PAYLOAD, 2), DiskStore(tmp_path, NS_A, 1, 4096, 2)]
    try:
        for store in stores:
            store.write(0, K(1), memoryview(data(1, store.payload_bytes)))
        status, doc = run_json(["disk", str(tmp_path), "--verify"], capsys)
        ns = by_ns(doc)[NS_A.hex()]
        assert (status, ns["ok"], ns["complete_chunks"], ns["incomplete_chunks"]) == (0, 2, 0, 1)
        assert ns["payload_bytes"] == {"4096": 1, str(PAYLOAD): 1}
        assert ns["capacity_bytes"] == 2 * SLOT + 2 * slot_bytes(4096)
        assert len(doc["warnings"]) == 1 and "disagree on their geometry" in doc["warnings"][0]
    finally:
        for store in stores:
            store.close()


@pytest.mark.parametrize(
    "name, rank",
    [
        ("slab.r0", 0),
        ("slab.r17", 17),
        ("slab.r4095", 4095),
        ("slab.r01", None),
        ("slab.r", None),
        ("slab.r-1", None),
        ("slab.r+1", None),
        ("slab.r1 ", None),
        ("slab.r1.tmp", None),
        ("slab.r\u0663", None),  # a non-ASCII digit
        ("slab.r4096", None),
        ("Slab.r1", None),
        ("slab.R1", None),
    ],
)
def test_slab_names(name: str, rank: int | None) -> None:
    assert parse_slab_name(name) == rank


def test_stray_slab_lookalikes_are_not_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = DiskStore(tmp_path, NS_A, 0, PAYLOAD, 2)
    try:
        store.write(0, K(1), memoryview(data(1)))
        ns = store.path.parent
        (ns / "slab.r3").mkdir()  # a directory
        (ns / "slab.r4").symlink_to(store.path)  # a link: not followed
        (ns / "slab.r5.tmp").write_bytes(store.path.read_bytes())
        status, doc = run_json(["disk", str(tmp_path), "--verify"], capsys)
        assert (status, doc["stray"]) == (0, 3)
        assert by_ns(doc)[NS_A.hex()]["shares_per_rank"] == {"0": 1}
        assert by_ns(doc)[NS_A.hex()]["world_size"] == 1
    finally:
        store.close()


def test_only_headers_are_read_without_verify_and_files_are_opened_read_only(
    tree: Tree, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[int] = []
    reads: list[int] = []
    real_open, real_pread = os.open, os.pread

    def spy_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        opened.append(flags)
        return real_open(path, flags, *args, **kwargs)

    def spy_pread(fd: int, size: int, offset: int) -> bytes:
        reads.append(size)
        return real_pread(fd, size, offset)

    def no_write(*args: Any) -> int:
        raise AssertionError("inspect wrote")

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "pread", spy_pread)
    for name in ("write", "pwrite", "pwritev", "ftruncate", "truncate", "unlink", "rename"):
        monkeypatch.setattr(os, name, no_write)
    assert main(["disk", str(tree.root)]) == 0
    assert len(opened) == 3 + 4  # every slab file (one of them empty), once
    assert all(flags & os.O_ACCMODE == os.O_RDONLY for flags in opened)
    superblocks = reads.count(SUPERBLOCK_BYTES)
    assert superblocks == 7 and len(reads) - superblocks == 3 * SLOTS + 2  # B's r1 is short
    assert set(reads) == {SUPERBLOCK_BYTES, SLOT_HEAD_BYTES}
    reads.clear()
    capsys.readouterr()
    assert main(["disk", str(tree.root), "--verify"]) == 1
    # used slots with a valid header are read whole (header block and payload, or
    # up to the end of the file); empty slots and invalid headers are not
    assert (
        sorted(r for r in reads if r > SUPERBLOCK_BYTES)
        == [PAYLOAD_OFFSET + 100] + [PAYLOAD_OFFSET + PAYLOAD] * 10
    )


@pytest.mark.parametrize("error", [PermissionError, FileNotFoundError])
def test_unopenable_and_vanishing_slabs(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    error: type[OSError],
) -> None:
    """A slab that cannot be opened is a bad slab; one deleted between the listing
    and the open vanished. Neither stops the inspection."""
    stores = [DiskStore(tmp_path, NS_A, rank, PAYLOAD, 2) for rank in (0, 1)]
    for store in stores:
        store.write(0, K(1), memoryview(data(1)))
        store.close()
    refused = str(stores[1].path)
    real_open = os.open

    def guarded_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if str(path) == refused:  # tests may run as root: chmod would not do
            raise error(13, "refused for the test", path)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", guarded_open)
    status, doc = run_json(["disk", str(tmp_path), "--verify"], capsys)
    ns = by_ns(doc)[NS_A.hex()]
    assert (ns["ok"], ns["shares_per_rank"], ns["complete_chunks"]) == (1, {"0": 1}, 0)
    assert ns["world_size"] == 2  # rank 1's file is there, even if unreadable
    if error is PermissionError:
        assert status == 1 and ns["vanished"] == 0
        assert [(s["rank"], s["reason"]) for s in ns["bad_slabs"]] == [(1, "unreadable")]
        assert "refused for the test" in ns["bad_slabs"][0]["detail"]
    else:
        assert status == 0 and ns["vanished"] == 1 and ns["bad_slabs"] == []
        assert main(["disk", str(tmp_path)]) == 0
        assert f"note: {NS_A.hex()}: 1 slab files vanished" in capsys.readouterr().out


def test_an_unreadable_slot_is_bad_and_the_scan_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = DiskStore(tmp_path, NS_A, 0, PAYLOAD, 3)
    for slot in range(3):
        store.write(slot, K(slot), memoryview(data(slot)))
    store.close()
    real_pread = os.pread

    def failing_pread(fd: int, size: int, offset: int) -> bytes:
        if offset == slot_offset(1):
            raise OSError(5, "Input/output error")
        return real_pread(fd, size, offset)

    monkeypatch.setattr(os, "pread", failing_pread)
    status, doc = run_json(["disk", str(tmp_path), "--verify"], capsys)
    ns = by_ns(doc)[NS_A.hex()]
    assert (status, ns["ok"], ns["bad"], ns["complete_chunks"]) == (1, 2, {"unreadable": 1}, 2)
    assert ns["bad_examples"][0]["name"] == f"kvoffload-v1/{NS_A.hex()}/slab.r0 slot 1"
    assert ns["format_versions"] == {"1": 2, "?": 1}


def test_path_forms_and_namespace_filter(tree: Tree, capsys: pytest.CaptureFixture[str]) -> None:
    base = tree.root / "kvoffload-v1"
    _, doc = run_json(["disk", str(base)], capsys)
    assert len(doc["namespaces"]) == 3 and doc["location"] == str(tree.root)
    assert doc["stray"] == 4
    _, doc = run_json(["disk", str(base / NS_B.hex())], capsys)
    assert [ns["namespace"] for ns in doc["namespaces"]] == [NS_B.hex()]
    assert doc["location"] == str(tree.root)
    _, doc = run_json(["disk", str(tree.root), "--namespace", NS_A.hex().upper()], capsys)
    assert [ns["namespace"] for ns in doc["namespaces"]] == [NS_A.hex()]
    assert doc["stray"] == 3  # A's own: not the README beside the namespaces
    _, doc = run_json(["disk", str(tree.root), "--namespace", NS_B.hex()], capsys)
    assert doc["stray"] == 0
    status, doc = run_json(["disk", str(tree.root), "--namespace", NS_A.hex(), "--verify"], capsys)
    assert (status, doc["bad_total"]) == (1, 1)
    with pytest.raises(UsageError, match=f"is namespace {NS_B.hex()}, not {NS_A.hex()}"):
        main(["disk", str(base / NS_B.hex()), "--namespace", NS_A.hex()])


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["disk", "{tmp}/missing"], "no such directory"),
        (["disk", "{tmp}"], "not a kvoffload disk tier directory"),
        (["disk", "{tmp}/file"], "not a directory"),
        (["disk", "{tmp}", "--namespace", "xyz"], "not a namespace digest"),
        (["disk", "{tmp}", "--world-size", "0"], "not a positive integer"),
        (["tape", "{tmp}"], "invalid choice"),
        ([], "required"),
    ],
)
def test_usage_errors_are_one_line(tmp_path: Path, argv: list[str], needle: str) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(UsageError) as info:
        main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    message = str(info.value)
    assert needle in message and "\n" not in message


def test_an_absent_namespace_is_a_usage_error(tmp_path: Path) -> None:
    DiskStore(tmp_path, NS_A, 0, PAYLOAD, 1).close()
    with pytest.raises(UsageError, match=f"no namespace {NS_B.hex()} .*present: {NS_A.hex()}"):
        main(["disk", str(tmp_path), "--namespace", NS_B.hex()])


@pytest.mark.parametrize("argv", [["--help"], ["disk", "--help"], ["redis", "--help"]])
def test_help_exits_0(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "usage: kvoffload inspect" in out
    if argv[0] == "disk":
        assert "every used slot" in out and "temporary" not in out


def test_through_the_kvoffload_command(tree: Tree, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tree.root / "missing"
    assert cli.main(["inspect", "disk", str(missing)]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"kvoffload inspect: error: {missing}: no such directory\n"
    assert captured.out == ""
    assert cli.main(["inspect", "disk", str(tree.root), "--verify"]) == 1
    assert cli.main(["inspect", "disk", str(tree.root)]) == 0
    assert cli.main(["inspect", "disk", str(tree.root), "--namespace", NS_C.hex()]) == 0
    assert cli.main(["inspect", "disk", str(tree.root), "--namespace", NS_C.hex(), "--verify"]) == 1
    assert capsys.readouterr().err == ""


# ------------------------------------------- the verdict on one slot, against the reader

SIZE = PAYLOAD + 100  # not a page multiple: the slot has padding after the payload
STRIDE = slot_bytes(SIZE)


def damage_slot(offset: int, change: Callable[[bytes], bytes], size: int = 1) -> Any:
    return lambda store, path: patch(path, slot_offset(0, STRIDE) + offset, change, size)


def copy_slot_from(other_ns: bytes, other_rank: int) -> Any:
    """Slot 0 of another namespace's or rank's slab (holding the same chunk) here."""

    def apply(store: DiskStore, path: Path) -> None:
        other = DiskStore(store.path.parents[2], other_ns, other_rank, SIZE, 1)
        try:
            other.write(0, K(1), memoryview(data(1, SIZE)))
            with open(other.path, "rb") as src:
                src.seek(slot_offset(0, STRIDE))
                copy = src.read(STRIDE)
        finally:
            other.close()
        other.path.unlink()  # only the copy stays
        patch(path, slot_offset(0, STRIDE), lambda _: copy, STRIDE)

    return apply


def cut_at(offset: int) -> Any:
    return lambda store, path: os.truncate(path, slot_offset(0, STRIDE) + offset)


P = PAYLOAD_OFFSET
SLOT_DAMAGE = {
    "none": (lambda store, path: None, None),
    "first payload byte": (damage_slot(P, flip), "checksum"),
    "last payload byte": (damage_slot(P + SIZE - 1, flip), "checksum"),
    "padding": (damage_slot(P + SIZE, flip), None),  # not covered, not read
    "magic": (damage_slot(0, lambda _: b"XXXX", 4), "magic"),
    "version": (damage_slot(4, lambda _: b"\x02\x00", 2), "version"),
    "length": (damage_slot(8, lambda _: (1).to_bytes(8, "little"), 8), "length"),
    "namespace field": (damage_slot(16, flip), "format"),
    "storage key field": (damage_slot(32, flip), "key"),
    "checksum field": (damage_slot(48, flip), "checksum"),
    "group field": (damage_slot(56, lambda _: b"\x01\x00", 2), "group"),  # group 1 of 1
    "reserved bytes": (damage_slot(60, flip), None),  # not covered
    "chunk key after the header": (damage_slot(64, flip), "key"),
    "sequence number": (damage_slot(80, flip), None),  # only orders copies
    "header block padding": (damage_slot(SLOT_HEAD_BYTES, flip), None),
    "another rank's slot": (copy_slot_from(NS_A, 1), "key"),
    "another namespace's slot": (copy_slot_from(NS_B, 0), "format"),
    "cut in the payload": (cut_at(P + 100), "size"),
    "cut after the key": (cut_at(SLOT_HEAD_BYTES), "size"),
    "cut in the key": (cut_at(70), "key"),
}


@pytest.mark.parametrize("what", list(SLOT_DAMAGE))
def test_the_verdict_on_a_slot_is_the_readers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], what: str
) -> None:
    """Whatever the damage, inspect accepts a slot exactly when the disk tier's reader
    does, for the same reason. The reader reads through the store opened before the
    damage (reopening would repair the file's size)."""
    apply, reason = SLOT_DAMAGE[what]
    store = DiskStore(tmp_path, NS_A, 0, SIZE, 1)
    try:
        store.write(0, K(1), memoryview(data(1, SIZE)))
        apply(store, store.path)
        engine = reader_verdict(store, 0, K(1))
    finally:
        store.close()
    status, doc = run_json(["disk", str(tmp_path), "--namespace", NS_A.hex(), "--verify"], capsys)
    ns = by_ns(doc)[NS_A.hex()]
    found = [e["reason"] for e in ns["bad_examples"]]
    assert (engine, found[0] if found else None) == (reason, reason)
    assert (status, ns["ok"], ns["complete_chunks"]) == (
        (0, 1, 1) if reason is None else (1, 0, 1 if reason in ("checksum", "size") else 0)
    )
