"""The self-verifying format of a chunk stored below host memory (disk, Redis).

A stored chunk is a 64-byte header followed by the payload (the chunk's bytes as
the host slab holds them)::

    offset size field
         0    4 magic  b"KVOC"
         4    2 format version (1)
         6    2 flags (0)
         8    8 payload length in bytes
        16   16 format digest: the namespace and the worker's physical KV layout
        32   16 storage key (the chunk key bound to the parallel rank)
        48    8 xxh3-64 checksum of the payload
        56    8 reserved (0)

All little-endian. :func:`verify` checks every field against what the reader
expects; any mismatch raises :class:`IntegrityError` naming the reason, which the
reader turns into a counted miss (and deletes the bad copy). Pure functions.
"""

from __future__ import annotations

import enum
import struct

import xxhash

from kvoffload.core.errors import KvOffloadError

MAGIC = b"KVOC"
VERSION = 1
HEADER_BYTES = 64
_HEADER = struct.Struct("<4sHHQ16s16sQ8x")


class IntegrityReason(enum.Enum):
    SIZE = "size"  # truncated, or longer than the header says
    MAGIC = "magic"
    VERSION = "version"
    FORMAT = "format"  # another namespace or KV layout
    KEY = "key"
    LENGTH = "length"
    CHECKSUM = "checksum"


class IntegrityError(KvOffloadError):
    """Stored bytes that must not be used; ``reason`` says why."""

    def __init__(self, reason: IntegrityReason, detail: str = "") -> None:
        super().__init__(f"stored chunk rejected ({reason.value}){': ' + detail if detail else ''}")
        self.reason = reason


def checksum(payload: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def encode_header(format_digest: bytes, key: bytes, payload: bytes | memoryview) -> bytes:
    """The header for ``payload`` stored under ``key``."""
    if len(format_digest) != 16 or len(key) != 16:
        raise ValueError("format digest and key are 16 bytes each")
    return _HEADER.pack(MAGIC, VERSION, 0, len(payload), format_digest, key, checksum(payload))


def check_header(
    header: bytes | memoryview, format_digest: bytes, key: bytes, payload_bytes: int
) -> int:
    """Check a header's fields; return the payload checksum it promises."""
    if len(header) < HEADER_BYTES:
        raise IntegrityError(IntegrityReason.SIZE, f"{len(header)} header bytes")
    magic, version, _, length, digest, stored_key, check = _HEADER.unpack_from(header)
    if magic != MAGIC:
        raise IntegrityError(IntegrityReason.MAGIC)
    if version != VERSION:
        raise IntegrityError(IntegrityReason.VERSION, f"version {version}")
    if digest != format_digest:
        raise IntegrityError(IntegrityReason.FORMAT)
    if stored_key != key:
        raise IntegrityError(IntegrityReason.KEY)
    if length != payload_bytes:
        raise IntegrityError(IntegrityReason.LENGTH, f"{length} != {payload_bytes}")
    return int(check)


def check_payload(payload: bytes | memoryview, payload_bytes: int, expected: int) -> None:
    if len(payload) != payload_bytes:
        raise IntegrityError(IntegrityReason.SIZE, f"{len(payload)} of {payload_bytes} bytes")
    if checksum(payload) != expected:
        raise IntegrityError(IntegrityReason.CHECKSUM)


def verify(
    stored: bytes | memoryview, format_digest: bytes, key: bytes, payload_bytes: int
) -> memoryview:
    """The payload of ``stored`` (header + payload) if every field matches; else
    :class:`IntegrityError`. Zero-copy: returns a view into ``stored``."""
    view = memoryview(stored)
    expected = check_header(view[:HEADER_BYTES], format_digest, key, payload_bytes)
    payload = view[HEADER_BYTES:]
    check_payload(payload, payload_bytes, expected)
    return payload
