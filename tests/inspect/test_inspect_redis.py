"""``kvoffload inspect redis`` against a private redis-server: counts, one bad value,
read-only commands only, vanished keys, the memory policy warning, one-line errors."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvoffload import cli
from kvoffload.core.chunk_format import HEADER_BYTES
from kvoffload.core.errors import UsageError
from kvoffload.core.keys import ChunkKey
from kvoffload.inspect_command import main
from kvoffload.inspection import redis_scan
from kvoffload.testing.redis_server import RedisServer, free_port, start_cluster
from kvoffload.tiers.redis_client import RedisSettings, key_name, make_client
from kvoffload.tiers.redis_store import RedisStore

NS_A = bytes(range(16))
NS_B = bytes(range(16, 32))
PAYLOAD = 4096
VALUE = HEADER_BYTES + PAYLOAD
READ_ONLY = {
    "hello",
    "client|setinfo",
    "scan",
    "strlen",
    "getrange",
    "get",
    "info",
    "config|resetstat",
}


def K(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def data(i: int) -> bytes:
    return bytes((i * 13 + j) % 256 for j in range(PAYLOAD))


def fill(server: RedisServer) -> str:
    """Namespace A: chunks 1..3 on ranks 0 and 1, chunk 4 on rank 0 only. Namespace B:
    chunks 1..2 on rank 0, chunk 2's value replaced by garbage. Returns the bad key."""
    client = make_client(RedisSettings(server.url))
    for ns, ranks, chunks in ((NS_A, (0, 1), (1, 2, 3)), (NS_B, (0,), (1, 2))):
        for rank in ranks:
            store = RedisStore(client, ns, rank, PAYLOAD)
            store.write_many([(K(i), memoryview(data(i))) for i in chunks])
    RedisStore(client, NS_A, 0, PAYLOAD).write_many([(K(4), memoryview(data(4)))])
    bad = key_name(NS_B, K(2), 0)
    server.client().set(bad, b"garbage" * 10)
    return bad


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    status = main([*argv, "--json"])
    return status, json.loads(capsys.readouterr().out)


def by_ns(doc: dict[str, Any]) -> dict[str, Any]:
    return {ns["namespace"]: ns for ns in doc["namespaces"]}


def snapshot(server: RedisServer) -> dict[bytes, bytes | None]:
    raw = server.client()
    return {name: raw.dump(name) for name in raw.scan_iter(count=1000)}


def test_counts_and_the_bad_value_with_read_only_commands(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = fill(redis_server)
    redis_server.client().set("unrelated", b"x")
    before = snapshot(redis_server)
    redis_server.client().config_resetstat()
    status, doc = run_json(["redis", redis_server.url], capsys)
    assert status == 0
    a, b = by_ns(doc)[NS_A.hex()], by_ns(doc)[NS_B.hex()]
    assert (a["complete_chunks"], a["incomplete_chunks"]) == (3, 1)
    assert a["shares_per_rank"] == {"0": 4, "1": 3} and a["bytes"] == 7 * VALUE
    assert a["format_versions"] == {"1": 7} and a["payload_bytes"] == {str(PAYLOAD): 7}
    assert (b["complete_chunks"], b["bytes"], b["world_size"]) == (2, VALUE + 70, 1)
    assert b["format_versions"] == {"1": 1, "?": 1}
    status, doc = run_json(["redis", redis_server.url, "--verify"], capsys)
    assert status == 1
    a, b = by_ns(doc)[NS_A.hex()], by_ns(doc)[NS_B.hex()]
    assert (a["ok"], a["bad"], b["ok"], b["bad"]) == (7, {}, 1, {"magic": 1})
    assert [e["name"] for e in b["bad_examples"]] == [bad]
    stats = redis_server.client().info("commandstats")
    used = {name.removeprefix("cmdstat_") for name in stats}
    assert {"scan", "strlen", "getrange", "get", "info"} <= used <= READ_ONLY, used
    assert snapshot(redis_server) == before


def test_chunks_are_counted_per_kv_cache_group(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """Namespace A of a two-group layout: chunks 1 (group 0) and 2, 3 (group 1) on
    both ranks, chunk 4 (group 1) on rank 0 only. Namespace B, one group: group 0.
    Counted from the headers, with or without ``--verify``; a value whose header names
    a group outside its own layout is bad (``group``)."""
    client = make_client(RedisSettings(redis_server.url))
    for rank in (0, 1):
        store = RedisStore(client, NS_A, rank, PAYLOAD, groups=2)
        items = [(K(i), memoryview(data(i))) for i in (1, 2, 3)]
        store.write_many(items, (), [0, 1, 1])
    RedisStore(client, NS_A, 0, PAYLOAD, groups=2).write_many(
        [(K(4), memoryview(data(4)))], (), [1]
    )
    RedisStore(client, NS_B, 0, PAYLOAD).write_many([(K(1), memoryview(data(1)))])
    for verify in ([], ["--verify"]):
        status, doc = run_json(["redis", redis_server.url, *verify], capsys)
        assert status == 0
        a, b = by_ns(doc)[NS_A.hex()], by_ns(doc)[NS_B.hex()]
        assert (a["complete_chunks"], a["incomplete_chunks"]) == (3, 1)
        assert a["chunks_per_group"] == {"0": 1, "1": 2}
        assert b["chunks_per_group"] == {"0": 1}
    assert main(["redis", redis_server.url]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = lines.index(next(line for line in lines if line.startswith("NAMESPACE")))
    assert " ".join(lines[head].split()[:6]) == "NAMESPACE CHUNKS INCOMPLETE CHUNKS PER GROUP"
    rows = {line.split()[0]: line.split() for line in lines[head + 1 : head + 3]}
    assert rows[NS_A.hex()][1:5] == ["3", "1", "g0=1", "g1=2"]
    assert rows[NS_B.hex()][1:4] == ["1", "0", "g0=1"]
    raw = redis_server.client()
    name = key_name(NS_A, K(2), 1)
    raw.setrange(name, 56, b"\x02\x00")  # group 2 of a layout of 2
    status, doc = run_json(["redis", redis_server.url, "--verify"], capsys)
    assert status == 1
    a = by_ns(doc)[NS_A.hex()]
    assert a["bad"] == {"group": 1} and [e["name"] for e in a["bad_examples"]] == [name]


def test_memory_settings_and_the_policy_warning(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    fill(redis_server)
    assert main(["redis", redis_server.url]) == 0
    text = capsys.readouterr().out
    assert "maxmemory-policy noeviction" in text
    assert "warning: maxmemory-policy is noeviction" in text
    assert "warning: maxmemory is 0" in text
    raw = redis_server.client()
    raw.config_set("maxmemory-policy", "allkeys-lru")
    raw.config_set("maxmemory", "64mb")
    status, doc = run_json(["redis", redis_server.url], capsys)
    assert status == 0 and doc["warnings"] == []
    assert doc["server"]["maxmemory"] == 64 << 20
    assert doc["server"]["maxmemory_policy"] == "allkeys-lru"


def test_namespace_filter_wrong_type_and_stray_keys(
    redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    fill(redis_server)
    raw = redis_server.client()
    raw.hset(key_name(NS_A, K(9), 0), "a", "b")  # a hash under a share's name
    raw.set(f"kvoffload:v1:{NS_A.hex()}:junk", b"x")
    status, doc = run_json(
        ["redis", redis_server.url, "--verify", "--namespace", NS_A.hex()], capsys
    )
    assert status == 1
    assert [ns["namespace"] for ns in doc["namespaces"]] == [NS_A.hex()]
    assert by_ns(doc)[NS_A.hex()]["bad"] == {"type": 1}
    assert doc["stray"] == 1
    empty = bytes(16).hex()
    status, doc = run_json(["redis", redis_server.url, "--namespace", empty], capsys)
    assert status == 0
    assert by_ns(doc)[empty]["complete_chunks"] == 0 and by_ns(doc)[empty]["shares"] == 0


class VanishingClient:
    """A client whose SCAN also lists keys that are gone by the time they are
    fetched (evicted), and lists one real key twice (as SCAN may)."""

    def __init__(self, client: Any, ghosts: list[str]) -> None:
        self._client = client
        self._ghosts = ghosts

    def scan_iter(self, **kwargs: Any) -> Iterator[bytes]:
        names = list(self._client.scan_iter(**kwargs))
        yield from [*names[:1], *(g.encode() for g in self._ghosts), *names]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


@pytest.mark.parametrize("verify", [False, True])
def test_keys_vanishing_between_scan_and_get(
    redis_server: RedisServer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    verify: bool,
) -> None:
    fill(redis_server)
    ghosts = [key_name(NS_A, K(50 + i), 0) for i in range(3)]
    monkeypatch.setattr(
        redis_scan, "make_client", lambda s: VanishingClient(make_client(s), ghosts)
    )
    status, doc = run_json(["redis", redis_server.url, *(["--verify"] * verify)], capsys)
    a = by_ns(doc)[NS_A.hex()]
    assert (a["vanished"], a["shares_per_rank"], a["complete_chunks"]) == (3, {"0": 4, "1": 3}, 3)
    assert status == int(verify)  # namespace B's garbage value, when verifying
    assert main(["redis", redis_server.url]) == 0
    assert f"note: {NS_A.hex()}: 3 values vanished" in capsys.readouterr().out


def test_an_unreachable_server_is_one_line_without_the_password() -> None:
    url = f"redis://user:s3cret@127.0.0.1:{free_port()}/0"
    start = time.monotonic()
    with pytest.raises(UsageError) as info:
        main(["redis", url, "--timeout-ms", "300"])
    message = str(info.value)
    assert time.monotonic() - start < 5
    assert message.startswith("Redis at redis://user:***@127.0.0.1:") and "\n" not in message
    assert "s3cret" not in message


@pytest.mark.parametrize(
    "url, needle",
    [
        ("http://localhost:6379", "not a redis:// or rediss:// URL"),
        ("redis://", "not a valid"),
        ("redis://localhost:99999", "not a valid"),
        ("redis://localhost:6379/0?socket_timeout=abc", "Invalid value for .socket_timeout."),
    ],
)
def test_a_bad_url_is_a_usage_error(url: str, needle: str) -> None:
    with pytest.raises(UsageError, match=needle):
        main(["redis", url])


def test_errors_through_the_kvoffload_command(capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    status = cli.main(["inspect", "redis", f"redis://127.0.0.1:{port}", "--timeout-ms", "300"])
    captured = capsys.readouterr()
    assert status == 2 and captured.out == ""
    assert captured.err.startswith(f"kvoffload inspect: error: Redis at redis://127.0.0.1:{port}:")
    assert captured.err.count("\n") == 1


def test_credentials_from_the_option_or_the_environment(
    tmp_path_factory: pytest.TempPathFactory,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = RedisServer(
        tmp_path_factory.mktemp("redis"),
        extra=("--requirepass", "right"),
        client_kwargs={"password": "right"},
    ).start()
    try:
        url = f"redis://127.0.0.1:{server.port}"
        assert cli.main(["inspect", "redis", url, "--password", "wrong"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvoffload inspect: error: Redis at ") and err.count("\n") == 1
        assert "wrong" not in err
        assert cli.main(["inspect", "redis", url, "--password", "right"]) == 0
        monkeypatch.setenv("REDISCLI_AUTH", "right")
        assert cli.main(["inspect", "redis", url]) == 0
        assert "no kvoffload namespaces found" in capsys.readouterr().out
    finally:
        server.kill()


def test_a_cluster_is_scanned_on_every_primary(
    tmp_path_factory: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    nodes = start_cluster(tmp_path_factory.mktemp("cluster"))
    try:
        url = nodes[0].url
        client = make_client(RedisSettings(url, cluster=True))
        for ns in (NS_A, NS_B):
            store = RedisStore(client, ns, 0, PAYLOAD)
            store.write_many([(K(i), memoryview(data(i))) for i in range(40)])
        client.set(key_name(NS_B, K(7), 0), b"garbage")
        status, doc = run_json(["redis", url, "--cluster", "--verify"], capsys)
        assert status == 1
        a, b = by_ns(doc)[NS_A.hex()], by_ns(doc)[NS_B.hex()]
        assert (a["complete_chunks"], a["ok"], b["ok"], b["bad"]) == (40, 40, 39, {"size": 1})
        assert doc["server"]["nodes"] == 3
        client.close()
    finally:
        for node in nodes:
            node.kill()
