"""How kvoffload reaches a Redis/Valkey server: credentials (in the URL or as separate
keys), TLS (``rediss://``), Redis Cluster, and URLs or clusters that are wrong or
down at start."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from kvoffload.core.errors import ConfigError
from kvoffload.core.keys import ChunkKey
from kvoffload.testing.redis_server import RedisServer, free_cluster_port, start_cluster
from kvoffload.tiers.redis_client import RedisSettings, make_client
from kvoffload.tiers.redis_index import RedisIndex
from kvoffload.tiers.redis_store import RedisStore
from kvoffload.tiers.remote_index import RemoteIndexOptions

DIGEST = bytes(range(16))
LONG_RETRY = RemoteIndexOptions(retry_s=30)  # a failed probe backs off for the whole test
PAYLOAD = 4096


def K(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def data(i: int) -> bytes:
    return bytes((i * 7 + j) % 251 for j in range(PAYLOAD))


def round_trip(settings: RedisSettings, keys: range = range(3)) -> list[str | None]:
    """Write chunks through a fresh client, read them back; the per-chunk failures."""
    s = RedisStore(make_client(settings), DIGEST, 0, PAYLOAD)
    assert s.write_many([(K(i), memoryview(data(i))) for i in keys]) == [None] * len(keys)
    outs = [bytearray(PAYLOAD) for _ in keys]
    failures = s.read_many([K(i) for i in keys], (), [memoryview(o) for o in outs])
    assert [bytes(o) for o, f in zip(outs, failures, strict=True) if f is None] == [
        data(i) for i, f in zip(keys, failures, strict=True) if f is None
    ]
    return failures


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(
        tmp_path,
        extra=("--requirepass", "s3cret", "--user", "kvo", "on", ">pw", "~kvoffload:*", "+@all"),
        client_kwargs={"password": "s3cret"},
    ).start()
    try:
        yield server
    finally:
        server.kill()


def test_credentials_in_the_url_or_as_separate_keys(secured: RedisServer) -> None:
    base = f"127.0.0.1:{secured.port}/0"
    assert round_trip(RedisSettings(f"redis://:s3cret@{base}")) == [None] * 3
    assert round_trip(RedisSettings(f"redis://kvo:pw@{base}")) == [None] * 3
    assert round_trip(RedisSettings(f"redis://{base}", username="kvo", password="pw")) == [None] * 3
    # Separate keys override the URL's.
    assert round_trip(RedisSettings(f"redis://kvo:wrong@{base}", password="pw")) == [None] * 3
    with pytest.raises(redis.AuthenticationError):
        round_trip(RedisSettings(f"redis://kvo:wrong@{base}"))


def test_wrong_credentials_make_the_index_back_off_not_fail(secured: RedisServer) -> None:
    settings = RedisSettings(f"redis://:nope@127.0.0.1:{secured.port}/0", timeout_ms=200)
    index = RedisIndex(make_client(settings), DIGEST, world_size=1, options=LONG_RETRY)
    try:
        deadline = time.monotonic() + 10
        while index.present_run([K(1)]) is None:  # asks in the background, fails
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert index.present_run([K(1)]) == 0 and index.query_errors >= 1
    finally:
        index.close()


def make_certificates(directory: Path) -> tuple[Path, Path, Path]:
    """A throwaway CA and a server certificate for 127.0.0.1 (openssl)."""
    ca_key, ca, key, csr, cert = (
        directory / n for n in ("ca.key", "ca.pem", "server.key", "server.csr", "server.pem")
    )
    ext = directory / "san.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key),
            "-out", str(ca), "-days", "1", "-subj", "/CN=kvoffload test CA")  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
            "-subj", "/CN=127.0.0.1")  # fmt: skip
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
            "-CAcreateserial", "-out", str(cert), "-days", "1", "-extfile", str(ext))  # fmt: skip
    return ca, cert, key


def test_tls_with_a_rediss_url(tmp_path: Path) -> None:
    ca, cert, key = make_certificates(tmp_path)
    server = RedisServer(
        tmp_path,
        extra=(
            *("--tls-port", "--tls-auth-clients", "no"),
            *("--tls-cert-file", str(cert), "--tls-key-file", str(key)),
            *("--tls-ca-cert-file", str(ca)),
        ),
        client_kwargs={"ssl": True, "ssl_ca_certs": str(ca)},
        scheme="rediss",
    ).start()
    try:
        assert round_trip(RedisSettings(f"{server.url}?ssl_ca_certs={ca}")) == [None] * 3
        # Plain text to a TLS port, or TLS without trusting the CA: errors, not hangs.
        with pytest.raises(redis.RedisError):
            round_trip(RedisSettings(f"redis://127.0.0.1:{server.port}/0", timeout_ms=500))
        with pytest.raises(redis.ConnectionError):
            round_trip(RedisSettings(server.url, timeout_ms=500))
    finally:
        server.kill()


def test_redis_cluster_spreads_chunks_over_every_node(tmp_path: Path) -> None:
    servers = start_cluster(tmp_path)
    try:
        settings = RedisSettings(servers[0].url, cluster=True)
        keys = range(40)
        assert round_trip(settings, keys) == [None] * 40
        assert all(s.client().dbsize() > 0 for s in servers)  # every master holds some
        index = RedisIndex(make_client(settings), DIGEST, world_size=1)
        try:
            deadline = time.monotonic() + 10
            while (run := index.present_run([K(i) for i in keys])) is None:
                assert time.monotonic() < deadline
                time.sleep(0.005)
            assert run == 40
        finally:
            index.close()
        s = RedisStore(make_client(settings), DIGEST, 0, PAYLOAD)
        s.delete_many([K(i) for i in keys])  # keys in many slots: split per node
        assert sum(server.client().dbsize() for server in servers) == 0
    finally:
        for server in servers:
            server.kill()


def test_a_cluster_that_is_down_at_start_fails_operations_not_the_engine() -> None:
    settings = RedisSettings(
        f"redis://127.0.0.1:{free_cluster_port()}/0", cluster=True, timeout_ms=200
    )
    client = make_client(settings)  # connects lazily: no error here
    s = RedisStore(client, DIGEST, 0, PAYLOAD)
    with pytest.raises(redis.ConnectionError):
        s.write_many([(K(1), memoryview(data(1)))])
    index = RedisIndex(client, DIGEST, world_size=1, options=LONG_RETRY)
    try:
        deadline = time.monotonic() + 10
        while index.present_run([K(1)]) is None:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert index.query_errors >= 1
    finally:
        index.close()


@pytest.mark.parametrize("url", ["redis://127.0.0.1:notaport/0", "redis://:99999999"])
def test_an_unusable_url_is_a_config_error(url: str) -> None:
    with pytest.raises(ConfigError, match="redis_url"):
        make_client(RedisSettings(url))
