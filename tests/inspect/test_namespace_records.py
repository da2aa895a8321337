"""Namespace records: written once by the scheduler half next to the chunks (disk
``namespace.json``, one Redis key), read back by ``kvoffload inspect``, which shows
each namespace's fields, or "fields unknown" for a namespace without a record."""

from __future__ import annotations

import json
import logging
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from kvoffload.adapters.vllm.startup import record_namespace
from kvoffload.core.identity.namespace_record import decode_record, encode_record
from kvoffload.core.keys import ChunkKey, Namespace
from kvoffload.inspect_command import main
from kvoffload.testing.redis_server import RedisServer
from kvoffload.tiers.disk import DiskStore, namespace_dir
from kvoffload.tiers.disk_record import RECORD_FILE, read_disk_record, write_disk_record
from kvoffload.tiers.disk_tier import DISK
from kvoffload.tiers.namespace_records import read_namespace_record
from kvoffload.tiers.redis_client import RedisSettings, make_client
from kvoffload.tiers.redis_record import record_key, write_redis_record
from kvoffload.tiers.redis_store import RedisStore
from kvoffload.tiers.redis_tier import REDIS
from kvoffload.tiers.registry import HOST

NS = Namespace(
    "org/tiny@main", "layout12", "torch.float32", "tp1-pp1", config="c" * 24, weights="w" * 24
)
OLD = Namespace("org/old@main", "layout12", "torch.float32")  # never recorded
PAYLOAD = 4096


def fill_disk(root: Path, namespace: Namespace) -> None:
    store = DiskStore(root, namespace.digest(), 0, PAYLOAD, 2)
    store.write(0, ChunkKey(bytes(16)), memoryview(bytes(PAYLOAD)))
    store.close()


def inspect_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    return {ns["namespace"]: ns for ns in doc["namespaces"]}


def test_a_record_round_trips_and_rejects_what_is_not_its_namespace() -> None:
    raw = encode_record(NS)
    assert decode_record(raw, NS.digest().hex()) == NS.fields()
    assert decode_record(raw, OLD.digest().hex()) is None  # another namespace's record
    forged = json.loads(raw)
    forged["config"] = "d" * 24  # fields that do not hash to the digest
    assert decode_record(json.dumps(forged), NS.digest().hex()) is None
    for garbage in (b"", b"\xff", b"[]", b'{"format": "x"}', b"{" * 70000):
        assert decode_record(garbage, NS.digest().hex()) is None


def test_the_disk_record_is_owner_only_atomic_and_written_once(tmp_path: Path) -> None:
    path = write_disk_record(tmp_path, NS)
    assert path == namespace_dir(tmp_path, NS.digest()) / RECORD_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert read_disk_record(path.parent, NS.digest().hex()) == NS.fields()
    inode = path.stat().st_ino
    write_disk_record(tmp_path, NS)  # the same content: left as it is
    assert path.stat().st_ino == inode
    assert sorted(os.listdir(path.parent)) == [RECORD_FILE]  # no temporary left
    path.write_text("damaged")
    write_disk_record(tmp_path, NS)  # a bad record is replaced whole
    assert read_disk_record(path.parent, NS.digest().hex()) == NS.fields()
    assert path.stat().st_ino != inode


def test_a_failed_record_is_logged_never_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    # kvoffload's logger may route through vLLM's handlers (no propagation) and an
    # earlier in-process run may have raised its level: listen on it directly.
    ours = logging.getLogger("kvoffload")
    level = ours.level
    ours.addHandler(caplog.handler)
    ours.setLevel(logging.DEBUG)
    try:
        record_namespace(DISK.records, blocker, NS)
    finally:
        ours.removeHandler(caplog.handler)
        ours.setLevel(level)
    assert "could not record namespace" in caplog.text and NS.digest().hex() in caplog.text


def test_each_tier_reads_back_through_its_spec_what_it_recorded(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    client = make_client(RedisSettings(redis_server.url))
    for spec, where in ((DISK, tmp_path), (REDIS, client)):
        assert read_namespace_record(spec.records, where, NS.digest().hex()) is None
        record_namespace(spec.records, where, NS)
        assert read_namespace_record(spec.records, where, NS.digest().hex()) == NS.fields()
        assert read_namespace_record(spec.records, where, OLD.digest().hex()) is None
    assert read_disk_record(namespace_dir(tmp_path, NS.digest()), NS.digest().hex())
    assert redis_server.client().get(record_key(NS.digest())) == encode_record(NS)


def test_a_tier_without_records_records_nothing(tmp_path: Path) -> None:
    assert HOST.records is None
    record_namespace(HOST.records, tmp_path, NS)
    assert read_namespace_record(HOST.records, tmp_path, NS.digest().hex()) is None
    assert os.listdir(tmp_path) == []


def test_inspect_disk_shows_each_namespaces_fields(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fill_disk(tmp_path, NS)
    fill_disk(tmp_path, OLD)
    write_disk_record(tmp_path, NS)
    namespaces = inspect_json(["disk", str(tmp_path)], capsys)
    assert namespaces[NS.digest().hex()]["record"] == NS.fields()
    assert namespaces[NS.digest().hex()]["complete_chunks"] == 1
    assert namespaces[OLD.digest().hex()]["record"] is None
    assert main(["disk", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "stray" not in text  # the record is not a stray name
    rows = {line.split()[0]: line.split() for line in text.splitlines() if line}
    assert rows[NS.digest().hex()][1:] == [
        "org/tiny", "main", "c" * 24, "w" * 24, "layout12", "torch.float32", "tp1-pp1"
    ]  # fmt: skip
    assert rows[OLD.digest().hex()][1:3] == ["fields", "unknown"]


def test_inspect_redis_shows_each_namespaces_fields(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    client = make_client(RedisSettings(redis_server.url))
    for namespace in (NS, OLD):
        RedisStore(client, namespace.digest(), 0, PAYLOAD).write_many(
            [(ChunkKey(bytes(16)), memoryview(bytes(PAYLOAD)))]
        )
    write_redis_record(client, NS)
    assert redis_server.client().get(record_key(NS.digest())) == encode_record(NS)
    namespaces = inspect_json(["redis", redis_server.url], capsys)
    assert namespaces[NS.digest().hex()]["record"] == NS.fields()
    assert namespaces[NS.digest().hex()]["complete_chunks"] == 1  # the record is no chunk
    assert namespaces[OLD.digest().hex()]["record"] is None
    assert main(["redis", redis_server.url]) == 0
    text = capsys.readouterr().out
    assert "stray" not in text
    assert "fields unknown" in text and "org/tiny" in text


def test_a_record_without_chunks_is_an_empty_namespace(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """The server evicted every chunk but the record: inspect still names the model."""
    write_redis_record(make_client(RedisSettings(redis_server.url)), NS)
    namespaces = inspect_json(["redis", redis_server.url], capsys)
    assert namespaces == {NS.digest().hex(): namespaces[NS.digest().hex()]}
    assert namespaces[NS.digest().hex()]["record"] == NS.fields()
    assert namespaces[NS.digest().hex()]["shares"] == 0
