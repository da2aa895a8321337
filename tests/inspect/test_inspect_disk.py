"""``kvoffload inspect disk``: counts, bytes, verification by reason, read-only,
one-line usage errors."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import pytest

from kvoffload import cli
from kvoffload.core.chunk_format import (
    HEADER_BYTES,
    IntegrityError,
    IntegrityReason,
    encode_header,
)
from kvoffload.core.errors import UsageError
from kvoffload.core.keys import ChunkKey, shard_key
from kvoffload.inspect_command import main
from kvoffload.inspection import disk_scan
from kvoffload.inspection.model import check_stored
from kvoffload.tiers.disk import PAYLOAD_OFFSET, DiskStore, file_bytes

NS_A = bytes(range(16))
NS_B = bytes(range(16, 32))
PAYLOAD = 8192
FILE = file_bytes(PAYLOAD)
TMP_BYTES = b"half a chunk"


def K(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def data(i: int) -> bytes:
    return bytes((i * 7 + j) % 256 for j in range(PAYLOAD))


def build_tree(root: Path) -> dict[str, Path]:
    """Two namespaces x two ranks x chunks 1..3; in A also chunk 4 on rank 0 only and a
    leftover temporary file; A's chunk 2 rank 1 truncated by 100 bytes; B's chunk 3
    rank 0 with one payload byte flipped."""
    stores = {
        (ns, rank): DiskStore(root, ns, rank, PAYLOAD) for ns in (NS_A, NS_B) for rank in (0, 1)
    }
    for store in stores.values():
        for i in (1, 2, 3):
            store.write(K(i), memoryview(data(i)))
    stores[NS_A, 0].write(K(4), memoryview(data(4)))
    tmp = stores[NS_A, 1].path(K(4)).with_name(stores[NS_A, 1].path(K(4)).name + ".tmp.4242.0")
    tmp.write_bytes(TMP_BYTES)
    truncated = stores[NS_A, 1].path(K(2))
    truncated.write_bytes(truncated.read_bytes()[:-100])
    flipped = stores[NS_B, 0].path(K(3))
    raw = bytearray(flipped.read_bytes())
    raw[PAYLOAD_OFFSET + 500] ^= 0x01
    flipped.write_bytes(bytes(raw))
    return {"truncated": truncated, "flipped": flipped, "tmp": tmp}


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


def test_counts_bytes_and_temporary_files_without_verify(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    build_tree(tmp_path)
    status, doc = run_json(["disk", str(tmp_path)], capsys)
    assert status == 0
    ns = by_ns(doc)
    assert list(ns) == [NS_A.hex(), NS_B.hex()]
    a, b = ns[NS_A.hex()], ns[NS_B.hex()]
    assert (a["complete_chunks"], a["incomplete_chunks"], a["world_size"]) == (3, 1, 2)
    assert a["shares_per_rank"] == {"0": 4, "1": 3}
    assert a["bytes"] == 7 * FILE - 100
    assert (a["temporary_files"], a["temporary_bytes"]) == (1, len(TMP_BYTES))
    assert a["format_versions"] == {"1": 7} and a["payload_bytes"] == {str(PAYLOAD): 7}
    assert (b["complete_chunks"], b["incomplete_chunks"], b["bytes"]) == (3, 0, 6 * FILE)
    assert b["temporary_files"] == 0
    assert "ok" not in a and doc["bad_total"] == 0 and doc["stray"] == 0


def test_verify_names_the_bad_files_by_reason_and_changes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    damaged = build_tree(tmp_path)
    before = listing(tmp_path)
    status, doc = run_json(["disk", str(tmp_path), "--verify"], capsys)
    assert status == 1
    a, b = by_ns(doc)[NS_A.hex()], by_ns(doc)[NS_B.hex()]
    assert (a["ok"], a["bad"], b["ok"], b["bad"]) == (6, {"size": 1}, 5, {"checksum": 1})
    assert [e["name"] for e in a["bad_examples"]] == [
        str(damaged["truncated"].relative_to(tmp_path))
    ]
    assert [e["reason"] for e in b["bad_examples"]] == ["checksum"]
    assert b["bad_examples"][0]["name"] == str(damaged["flipped"].relative_to(tmp_path))
    assert doc["bad_total"] == 2
    assert main(["disk", str(tmp_path), "--verify"]) == 1  # the table, too
    text = capsys.readouterr().out
    assert f"bad: {damaged['truncated'].relative_to(tmp_path)}: stored chunk rejected" in text
    assert "result: 2 of 13 files bad" in text
    assert re.search(
        rf"^{NS_A.hex()}\s+3\s+1\s+r0=4 r1=3\s+.*KiB\s+8\.0 KiB\s+1\s+1 \(12 B\)$", text, re.M
    )
    assert re.search(rf"^{NS_B.hex()}\s+5\s+1\s+checksum=1$", text, re.M)
    assert listing(tmp_path) == before
    assert damaged["tmp"].exists()


def test_a_clean_tree_verifies_with_status_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for rank in (0, 1):
        store = DiskStore(tmp_path, NS_A, rank, PAYLOAD, o_direct=rank == 1)
        store.write(K(1), memoryview(data(1)))
    status, doc = run_json(["disk", str(tmp_path), "--verify"], capsys)
    assert status == 0
    assert by_ns(doc)[NS_A.hex()]["ok"] == 2 and doc["bad_total"] == 0
    assert main(["disk", str(tmp_path), "--verify"]) == 0
    assert "result: all files verified OK" in capsys.readouterr().out


def test_wrong_namespace_wrong_rank_and_garbage_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a0, a1 = DiskStore(tmp_path, NS_A, 0, PAYLOAD), DiskStore(tmp_path, NS_A, 1, PAYLOAD)
    b0 = DiskStore(tmp_path, NS_B, 0, PAYLOAD)
    a0.write(K(1), memoryview(data(1)))
    a1.path(K(1)).parent.mkdir(parents=True, exist_ok=True)
    a1.path(K(1)).write_bytes(a0.path(K(1)).read_bytes())  # rank 0's file as rank 1's
    b0.path(K(1)).parent.mkdir(parents=True, exist_ok=True)
    b0.path(K(1)).write_bytes(a0.path(K(1)).read_bytes())  # namespace A's file in B
    a0.path(K(2)).write_bytes(b"not a chunk" * 10)
    a0.write(K(3), memoryview(data(3)))
    a0.path(K(3)).write_bytes(a0.path(K(3)).read_bytes() + bytes(PAYLOAD))  # too long
    status, doc = run_json(["disk", str(tmp_path), "--verify"], capsys)
    assert status == 1
    assert by_ns(doc)[NS_A.hex()]["bad"] == {"key": 1, "magic": 1, "size": 1}
    assert by_ns(doc)[NS_B.hex()]["bad"] == {"format": 1}


def test_stray_names_are_counted_not_taken_for_chunks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = DiskStore(tmp_path, NS_A, 0, PAYLOAD)
    store.write(K(1), memoryview(data(1)))
    fanout = store.path(K(1)).parent
    (fanout / "notes.txt").write_text("hello")
    (fanout / f"{K(1).hex()}.r01").write_bytes(store.path(K(1)).read_bytes())
    misplaced = store.dir / "ff" / store.path(K(1)).name  # the engine never looks there
    misplaced.parent.mkdir()
    misplaced.write_bytes(store.path(K(1)).read_bytes())
    (tmp_path / "kvoffload-v1" / "README").write_text("x")
    status, doc = run_json(["disk", str(tmp_path), "--verify"], capsys)
    assert status == 0
    assert doc["stray"] == 4
    assert by_ns(doc)[NS_A.hex()]["shares_per_rank"] == {"0": 1}


def test_path_forms_namespace_filter_and_world_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    build_tree(tmp_path)
    base = tmp_path / "kvoffload-v1"
    _, doc = run_json(["disk", str(base)], capsys)
    assert len(doc["namespaces"]) == 2 and doc["location"] == str(tmp_path)
    _, doc = run_json(["disk", str(base / NS_B.hex())], capsys)
    assert [ns["namespace"] for ns in doc["namespaces"]] == [NS_B.hex()]
    _, doc = run_json(["disk", str(tmp_path), "--namespace", NS_A.hex().upper()], capsys)
    assert [ns["namespace"] for ns in doc["namespaces"]] == [NS_A.hex()]
    _, doc = run_json(["disk", str(tmp_path), "--world-size", "3"], capsys)
    assert by_ns(doc)[NS_A.hex()]["complete_chunks"] == 0
    assert by_ns(doc)[NS_A.hex()]["incomplete_chunks"] == 4


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
    DiskStore(tmp_path, NS_A, 0, PAYLOAD).write(K(1), memoryview(data(1)))
    with pytest.raises(UsageError, match=f"no namespace {NS_B.hex()} .*present: {NS_A.hex()}"):
        main(["disk", str(tmp_path), "--namespace", NS_B.hex()])


@pytest.mark.parametrize("argv", [["--help"], ["disk", "--help"], ["redis", "--help"]])
def test_help_exits_0(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0
    assert "usage: kvoffload inspect" in capsys.readouterr().out


def test_through_the_kvoffload_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing"
    assert cli.main(["inspect", "disk", str(missing)]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"kvoffload inspect: error: {missing}: no such directory\n"
    assert captured.out == ""
    build_tree(tmp_path)
    assert cli.main(["inspect", "disk", str(tmp_path), "--verify"]) == 1
    assert cli.main(["inspect", "disk", str(tmp_path)]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("error", [PermissionError, FileNotFoundError])
def test_unreadable_and_vanishing_files(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    error: type[OSError],
) -> None:
    """A file that cannot be read is bad; one deleted between the listing and the
    read (the engine evicting it) vanished. Neither stops the inspection."""
    store = DiskStore(tmp_path, NS_A, 0, PAYLOAD)
    store.write(K(1), memoryview(data(1)))
    store.write(K(2), memoryview(data(2)))
    refused = str(store.path(K(2)))

    def guarded_open(path: str, mode: str) -> IO[bytes]:
        if str(path) == refused:  # tests may run as root: chmod would not do
            raise error(13, "refused for the test", path)
        return open(path, mode)

    monkeypatch.setattr(disk_scan, "open", guarded_open, raising=False)
    status, doc = run_json(["disk", str(tmp_path), "--verify"], capsys)
    ns = by_ns(doc)[NS_A.hex()]
    if error is PermissionError:
        assert status == 1
        assert (ns["ok"], ns["bad"], ns["shares_per_rank"]) == (1, {"unreadable": 1}, {"0": 2})
        assert "refused for the test" in ns["bad_examples"][0]["detail"]
    else:
        assert status == 0
        assert (ns["ok"], ns["vanished"], ns["shares_per_rank"]) == (1, 1, {"0": 1})


def stored(key: ChunkKey, rank: int, payload: bytes, digest: bytes = NS_A) -> bytes:
    """A value as the Redis tier stores it: header, payload."""
    return encode_header(digest, shard_key(key, rank), payload) + payload


def disk_file(value: bytes) -> bytes:
    """The same chunk as the disk tier stores it: header block, payload, padding."""
    header, payload = value[:HEADER_BYTES], value[HEADER_BYTES:]
    return (header.ljust(PAYLOAD_OFFSET, b"\0") + payload).ljust(file_bytes(len(payload)), b"\0")


def flip_last(s: bytes) -> bytes:
    return s[:-1] + bytes([s[-1] ^ 1])


def flip_first(s: bytes) -> bytes:
    return bytes([s[0] ^ 1]) + s[1:]


HEADER_DAMAGE = [
    (lambda s: s[:40], IntegrityReason.SIZE),
    (lambda s: b"XXXX" + s[4:], IntegrityReason.MAGIC),
    (lambda s: s[:4] + b"\x02\x00" + s[6:], IntegrityReason.VERSION),
]
WRONG_CHUNK = [
    (lambda: stored(K(1), 0, data(1), NS_B), IntegrityReason.FORMAT),
    (lambda: stored(K(2), 0, data(1)), IntegrityReason.KEY),
    (lambda: stored(K(1), 1, data(1)), IntegrityReason.KEY),
]


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda s: s, None),
        (lambda s: s + b"x", IntegrityReason.SIZE),
        (lambda s: s[:-1], IntegrityReason.SIZE),
        (flip_last, IntegrityReason.CHECKSUM),
        *HEADER_DAMAGE,
        *[(lambda s, w=w: w(), r) for w, r in WRONG_CHUNK],
    ],
)
def test_check_stored_a_redis_value(
    make: Callable[[bytes], bytes], reason: IntegrityReason | None
) -> None:
    error = check_stored(make(stored(K(1), 0, data(1))), NS_A, K(1), 0)
    assert (error.reason if error else None) == reason


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda f: f, None),
        (lambda f: f[: PAYLOAD_OFFSET + PAYLOAD + 100], None),  # the reader needs no padding
        (lambda f: f + b"\0", IntegrityReason.SIZE),
        (lambda f: f[: PAYLOAD_OFFSET + PAYLOAD + 99], IntegrityReason.SIZE),
        (lambda f: f[:PAYLOAD_OFFSET], IntegrityReason.SIZE),
        (lambda f: f[:PAYLOAD_OFFSET] + flip_first(f[PAYLOAD_OFFSET:]), IntegrityReason.CHECKSUM),
        (flip_last, None),  # padding: not covered by the checksum, ignored by the reader
        (lambda f: b"XXXX" + f[4:], IntegrityReason.MAGIC),
        (lambda f: f[:4] + b"\x02\x00" + f[6:], IntegrityReason.VERSION),
        (lambda f: f[:8] + (1).to_bytes(8, "little") + f[16:], IntegrityReason.LENGTH),
        *[(lambda f, w=w: disk_file(w()), r) for w, r in WRONG_CHUNK],
    ],
)
def test_check_stored_agrees_with_the_disk_tier_reader(
    tmp_path: Path, make: Callable[[bytes], bytes], reason: IntegrityReason | None
) -> None:
    """What the engine's reader accepts or rejects (and why), inspect does too; a
    header whose length differs from the engine's payload size is only visible to
    inspect as another payload size (and, here, as a bad size)."""
    size = PAYLOAD + 100  # not a page multiple: the file has padding
    store = DiskStore(tmp_path, NS_A, 0, size)
    payload = data(1) + bytes(100)
    store.write(K(1), memoryview(payload))
    path = store.path(K(1))
    assert path.read_bytes() == disk_file(stored(K(1), 0, payload))  # the layout we model
    content = make(path.read_bytes())
    path.write_bytes(content)
    try:
        store.read_into(K(1), memoryview(bytearray(size)))
        engine = None
    except IntegrityError as exc:
        engine = exc.reason
    error = check_stored(
        content, NS_A, K(1), 0, payload_offset=PAYLOAD_OFFSET, max_bytes=file_bytes
    )
    expected = IntegrityReason.SIZE if reason is IntegrityReason.LENGTH else reason
    assert (engine, error.reason if error else None) == (reason, expected)
