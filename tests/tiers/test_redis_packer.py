"""The zero-copy RESP packer sends exactly the bytes redis-py's own packer would,
without copying large values."""

from __future__ import annotations

from typing import Any

import pytest
from redis.connection import PythonRespSerializer

from kvoffload.tiers.redis_client import ZeroCopyPacker


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
    buffer = bytearray(BIG)
    parts = ZeroCopyPacker().pack("SET", "k", memoryview(buffer))
    views = [p for p in parts if isinstance(p, memoryview)]
    assert [v.obj is buffer for v in views] == [True]  # the caller's own bytes, not a copy
    assert b"".join(bytes(p) for p in parts) == reference("SET", "k", BIG)


def test_memoryviews_of_other_formats_count_bytes() -> None:
    words = memoryview(bytearray(range(64))).cast("Q")  # 8 items, 64 bytes
    sent = b"".join(bytes(p) for p in ZeroCopyPacker().pack("SET", "k", words))
    assert sent == reference("SET", "k", bytes(range(64)))
