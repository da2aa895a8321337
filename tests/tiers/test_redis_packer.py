"""The zero-copy RESP packer sends exactly the bytes redis-py's own packer would,
without copying large values; a Joined value is one argument."""

from __future__ import annotations

from typing import Any

import pytest
from redis.connection import PythonRespSerializer

from kvoffload.tiers.redis_client import Joined, ZeroCopyPacker


def reference(*args: Any) -> bytes:
    def encode(v: Any) -> bytes:
        if isinstance(v, bytes):
            return v
        return str(v).encode() if not isinstance(v, memoryview) else bytes(v)

    return b"".join(bytes(p) for p in PythonRespSerializer(6000, encode).pack(*args))


BIG = bytes(range(256)) * 100  # 25,600 bytes: above the cutoff


@pytest.mark.parametrize(
    "args",
    [
        ("SET", "kvoffload:v1:k", b"small"),
        ("CLIENT SETINFO", "LIB-NAME", "redis-py"),
        (b"CONFIG GET", b"maxmemory"),
        ("SET", "k", BIG, "PX", 1500),
        ("DEL", "a", "b", "c"),
    ],
)
def test_plain_commands_match_redis_py(args: tuple[Any, ...]) -> None:
    assert b"".join(bytes(p) for p in ZeroCopyPacker().pack(*args)) == reference(*args)


def test_large_values_are_sent_without_copies() -> None:
    payload = memoryview(bytearray(BIG))
    parts = ZeroCopyPacker().pack("SET", "k", Joined(b"HEADER", payload))
    assert any(p is payload for p in parts)  # the slot's own view, not a copy
    sent = b"".join(bytes(p) for p in parts)
    assert sent == reference("SET", "k", b"HEADER" + BIG)


def test_memoryviews_of_other_formats_count_bytes() -> None:
    words = memoryview(bytearray(64)).cast("Q")  # 8 items, 64 bytes
    sent = b"".join(bytes(p) for p in ZeroCopyPacker().pack("SET", "k", Joined(b"h", words)))
    assert sent == reference("SET", "k", b"h" + bytes(64))
