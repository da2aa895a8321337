"""Sealed chunks in Redis on a real engine (issue 41, decision 0024), tried as another
client of the server who knows kvoffload's formats: what an unsealed engine stores is
nowhere in what a sealed one stores, and values forged every way that client can
(ciphertext bytes negated with the tier's checksum rewritten, values swapped between
keys, unsealed values under the sealed names) never change a restarted engine's
answers: they are counted misses (``integrity``) and the engine recomputes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llm_support import CHUNK_BYTES, PROMPTS, counted, engine, generate, half, settle, tokens

from kvoffload.core.chunk_format import HEADER_BYTES, checksum
from kvoffload.sealing.keyfile import write_new
from kvoffload.sealing.layout import SEAL_BYTES
from kvoffload.testing.redis_server import RedisServer


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path).start()
    try:
        yield server
    finally:
        server.kill()


def config(redis: RedisServer, key: Path | None) -> dict[str, Any]:
    extra: dict[str, Any] = {
        "cpu_bytes": 8 * CHUNK_BYTES,  # host memory: one prompt's chunks
        "redis_url": redis.url,
        "redis_timeout_ms": 2000,
        "tier_io_timeout_ms": 60_000,
        "load_policy": "always",
    }
    if key is not None:
        extra["seal_key_file"] = str(key)
    return extra


def chunk_values(client: Any) -> dict[bytes, bytes]:
    """Every chunk value in the server, by name (not the namespace records)."""
    names = [n for n in client.scan_iter(match="kvoffload:*", count=1000) if b":r" in n[-4:]]
    return {n: client.get(n) for n in names}


def store_each(llm: Any, client: Any) -> list[set[bytes]]:
    """Generate each prompt alone and settle; the names each one added to Redis."""
    added: list[set[bytes]] = []
    for prompt in PROMPTS:
        before = set(chunk_values(client))
        generate(llm, [prompt])
        settle(llm)
        added.append(set(chunk_values(client)) - before)
    return added


def with_checksum(value: bytes, payload: bytes) -> bytes:
    """``value``'s header over ``payload``: length and checksum rewritten, as any
    client of the server can (the unsealed format's checksum is not keyed)."""
    header = bytearray(value[:HEADER_BYTES])
    header[8:16] = len(payload).to_bytes(8, "little")
    header[48:56] = checksum(payload).to_bytes(8, "little")
    return bytes(header) + payload


def test_sealed_redis_keeps_no_kv_in_the_clear_and_forgeries_change_no_answer(
    tiny_model: Path, tmp_path: Path, redis_server: RedisServer
) -> None:
    client = redis_server.client()
    with engine(tiny_model, None) as llm:
        reference = tokens(generate(llm, PROMPTS))
    with engine(tiny_model, config(redis_server, None)) as llm:
        store_each(llm, client)
        plain = [v[HEADER_BYTES:] for v in chunk_values(client).values()]
    client.flushall()
    assert len(plain) == 4 * 8 and all(len(p) == CHUNK_BYTES for p in plain)

    key = tmp_path / "seal.key"
    write_new(key)
    with engine(tiny_model, config(redis_server, key)) as llm:
        assert half(llm).tiers.tier("redis") is not None
        added = store_each(llm, client)
        sealed = chunk_values(client)
        namespace = half(llm).namespace
    assert "+sealed:redis" in namespace.dtype
    assert [len(a) for a in added] == [8, 8, 8, 8]
    assert all(len(v) == HEADER_BYTES + CHUNK_BYTES + SEAL_BYTES for v in sealed.values())
    blob = b"\x00".join(sealed.values())
    runs = [p[i : i + 32] for p in plain for i in range(0, CHUNK_BYTES - 32, 509)]
    runs = [r for r in runs if len(set(r)) > 4]  # not a constant run (padding, zeros)
    assert len(runs) > 1000 and not any(r in blob for r in runs)

    # The forgeries, one prompt's chunks each; prompt 3's are left as they are.
    flip, swap, unsealed = (sorted(a) for a in added[:3])
    forged: dict[bytes, bytes] = {}
    for name in flip:
        value = sealed[name]
        payload = bytes(b ^ 0xFF for b in value[HEADER_BYTES:])
        forged[name] = with_checksum(value, payload)
    for name, other in zip(swap, swap[1:] + swap[:1], strict=True):
        header = sealed[name][:HEADER_BYTES]  # this name's key in the header, the other's bytes
        forged[name] = with_checksum(header, sealed[other][HEADER_BYTES:])
    for i, name in enumerate(unsealed):
        payload = plain[i] if i % 2 else plain[i] + bytes(SEAL_BYTES)  # both lengths
        forged[name] = with_checksum(sealed[name], payload)
    for name, value in forged.items():
        client.set(name, value)

    with engine(tiny_model, config(redis_server, key)) as llm:
        outputs = []
        for prompt in PROMPTS:  # one by one: a run stops at its first bad chunk
            outputs += generate(llm, [prompt])
            settle(llm)
        assert tokens(outputs) == reference
        bad = counted(llm, "integrity_errors_total", tier="redis", reason="seal")
        assert bad >= 3  # the first chunk of each forged prompt at least
        assert outputs[3].num_cached_tokens == len(PROMPTS[3])  # intact chunks still serve
        for i in range(3):
            assert outputs[i].num_cached_tokens < len(PROMPTS[i])
    # Each forged value read was deleted; the recomputed chunk was stored sealed anew.
    left = chunk_values(client)
    for name in (flip[0], swap[0], unsealed[0]):
        assert left.get(name) != forged[name]
