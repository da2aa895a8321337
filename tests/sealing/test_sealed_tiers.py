"""What another client of a shared store can do to sealed chunks, tried on the real
tiers (a redis-server, disk slabs): read them, rewrite them in the tier's own format
with a valid checksum, swap them between keys, write unsealed values under their
names. Every such value is a failed chunk (``integrity:seal``), deleted from Redis,
and its bytes never reach the caller's buffer as a chunk (decision 0024)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.contract.tier_envs import PAYLOAD, TierEnv, open_env

from kvoffload.core.chunk_format import HEADER_BYTES, encode_header
from kvoffload.core.failures import FailureKind
from kvoffload.core.keys import ChunkKey, shard_key
from kvoffload.sealing.store import SealedStore
from kvoffload.tiers.registry import LOWER_TIERS

REDIS = next(s for s in LOWER_TIERS if s.name == "redis")
DISK = next(s for s in LOWER_TIERS if s.name == "disk")


def K(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def chunk(i: int) -> bytes:
    return bytes((i * 7 + j * 13) % 256 for j in range(PAYLOAD))


@pytest.fixture
def redis_env(tmp_path: Path) -> Iterator[TierEnv]:
    with open_env(REDIS, tmp_path, sealed=True) as env:
        yield env


def raw_client(env: TierEnv) -> Any:
    store = env.stores[0]
    assert isinstance(store, SealedStore)
    return store.inner.client


def write(env: TierEnv, n: int) -> SealedStore:
    store = env.store()
    assert isinstance(store, SealedStore)
    assert store.write_many([(K(i), memoryview(chunk(i))) for i in range(n)], []) == [None] * n
    return store


def read(store: SealedStore, keys: list[ChunkKey]) -> tuple[list[Any], list[bytes]]:
    outs = [bytearray(PAYLOAD) for _ in keys]
    failures = store.read_many(keys, [], [memoryview(o) for o in outs])
    return failures, [bytes(o) for o in outs]


def rewrite(store: SealedStore, key: ChunkKey, payload: bytes) -> None:
    """Store ``payload`` under ``key``'s name in the tier's own format, checksum
    included: what any client of the server can do."""
    inner = store.inner
    header = encode_header(inner.digest, shard_key(key, inner.rank), payload)
    inner.client.set(inner.name(key), header + payload)


def test_another_client_finds_no_run_of_the_chunk(redis_env: TierEnv) -> None:
    store = write(redis_env, 4)
    values = [raw_client(redis_env).get(store.inner.name(K(i))) for i in range(4)]
    for i, value in enumerate(values):
        plain = chunk(i)
        assert all(plain[s : s + 16] not in value for s in range(0, PAYLOAD - 16, 61))
    assert read(store, [K(0)])[1][0] == chunk(0)


def test_flipped_bytes_with_a_valid_tier_checksum_are_refused_and_deleted(
    redis_env: TierEnv,
) -> None:
    store = write(redis_env, 2)
    value = raw_client(redis_env).get(store.inner.name(K(1)))
    forged = bytearray(value[HEADER_BYTES:])
    for at in range(40, len(forged) - 16, 50):
        forged[at] ^= 0xFF  # negate ciphertext bytes
    rewrite(store, K(1), bytes(forged))
    failures, got = read(store, [K(0), K(1)])
    assert failures[0] is None and got[0] == chunk(0)
    assert failures[1] is not None and failures[1].kind is FailureKind.INTEGRITY
    assert failures[1].detail == "seal"
    assert raw_client(redis_env).exists(store.inner.name(K(1))) == 0  # deleted


def test_values_swapped_between_keys_are_refused(redis_env: TierEnv) -> None:
    store = write(redis_env, 2)
    client = raw_client(redis_env)
    zero, one = (client.get(store.inner.name(K(i)))[HEADER_BYTES:] for i in range(2))
    rewrite(store, K(0), one)  # headers rewritten for the new key: only the seal can tell
    rewrite(store, K(1), zero)
    failures, _ = read(store, [K(0), K(1)])
    assert [f.detail if f else None for f in failures] == ["seal", "seal"]


def test_unsealed_values_under_sealed_names_are_refused(redis_env: TierEnv) -> None:
    store = write(redis_env, 1)
    from kvoffload.sealing.layout import SEAL_BYTES

    rewrite(store, K(0), bytes(PAYLOAD + SEAL_BYTES))  # right size, the tier's format
    failures, _ = read(store, [K(0)])
    assert failures[0] is not None and failures[0].detail == "seal"
    rewrite(store, K(0), chunk(0))  # a plain chunk, as an unsealed engine writes it
    failures, _ = read(store, [K(0)])
    assert failures[0] is not None and failures[0].kind is FailureKind.INTEGRITY


def test_a_sealed_disk_slot_rewritten_with_its_checksum_is_refused(tmp_path: Path) -> None:
    with open_env(DISK, tmp_path, sealed=True) as env:
        slots = env.index.book_spill([K(1)])
        assert slots is not None
        store = env.store()
        assert isinstance(store, SealedStore)
        assert store.write_many([(K(1), memoryview(chunk(1)))], slots.slots) == [None]
        # rewrite the slot through the disk's own store: its header and checksum are
        # right, only the seal can tell
        forged = bytearray(PAYLOAD + 48)
        forged[:4] = b"KVSL"
        store.inner.write_many([(K(1), memoryview(forged))], slots.slots)
        outs = [bytearray(PAYLOAD)]
        failures = store.read_many([K(1)], slots.slots, [memoryview(outs[0])])
        assert failures[0] is not None and failures[0].detail == "seal"
        assert bytes(outs[0]) != chunk(1)
