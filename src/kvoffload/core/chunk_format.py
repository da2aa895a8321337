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
        56    2 KV cache group of the chunk (:mod:`kvoffload.core.kv_groups`)
        58    2 KV cache groups of the layout, minus one
        60    4 reserved (0)

All little-endian. The two group fields were reserved bytes (0) before they were
defined, and 0 in both means what those chunks are: group 0 of a one-group layout.
So the format version stays 1: a one-group chunk written today is byte for byte what
was always written, and every chunk written before verifies as group 0.

:func:`verify` checks every field against what the reader expects; any mismatch
raises :class:`IntegrityError` naming the reason, which the reader turns into a
counted miss (and deletes the bad copy). The group is descriptive (the format digest
already keeps layouts apart) and checked where the reader knows which group it
expects: a chunk read back for group ``g`` whose header names another group, or a
header whose group is not below its own group count, is rejected with
:attr:`IntegrityReason.GROUP`. The group count is not compared with the reader's
layout (the digest binds the layout). Pure functions.
"""

from __future__ import annotations

import enum
import struct

import xxhash

from kvoffload.core.errors import KvOffloadError

MAGIC = b"KVOC"
VERSION = 1
HEADER_BYTES = 64
MAX_GROUPS = 1 << 16
"""The most KV cache groups a header can name (two bytes each field)."""
_HEADER = struct.Struct("<4sHHQ16s16sQHH4x")


class IntegrityReason(enum.Enum):
    SIZE = "size"  # truncated, or longer than the header says
    MAGIC = "magic"
    VERSION = "version"
    FORMAT = "format"  # another namespace or KV layout
    KEY = "key"
    LENGTH = "length"
    GROUP = "group"  # another KV cache group than the reader expects, or no valid group
    CHECKSUM = "checksum"
    SEAL = "seal"  # a sealed chunk that does not open (kvoffload.sealing, decision 0024)


class IntegrityError(KvOffloadError):
    """Stored bytes that must not be used; ``reason`` says why."""

    def __init__(self, reason: IntegrityReason, detail: str = "") -> None:
        super().__init__(f"stored chunk rejected ({reason.value}){': ' + detail if detail else ''}")
        self.reason = reason


def checksum(payload: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def encode_header(
    format_digest: bytes,
    key: bytes,
    payload: bytes | memoryview,
    *,
    group: int = 0,
    groups: int = 1,
) -> bytes:
    """The header for ``payload`` stored under ``key``, a chunk of KV cache group
    ``group`` of a layout of ``groups`` groups (``0 <= group < groups <=``
    :data:`MAX_GROUPS`, else ``ValueError``)."""
    if len(format_digest) != 16 or len(key) != 16:
        raise ValueError("format digest and key are 16 bytes each")
    if not 0 <= group < groups <= MAX_GROUPS:
        raise ValueError(f"group {group} of {groups} groups")
    return _HEADER.pack(
        MAGIC, VERSION, 0, len(payload), format_digest, key, checksum(payload), group, groups - 1
    )


def header_group(header: bytes | memoryview) -> tuple[int, int]:
    """``(group, groups)`` a header names, unchecked (``header`` holds at least
    :data:`HEADER_BYTES`); ``(0, 1)`` for every header written before the fields."""
    *_, group, more = _HEADER.unpack_from(header)
    return int(group), int(more) + 1


def check_header(
    header: bytes | memoryview,
    format_digest: bytes,
    key: bytes,
    payload_bytes: int,
    *,
    group: int | None = 0,
) -> int:
    """Check a header's fields; return the payload checksum it promises. ``group``:
    the KV cache group the reader expects (None: any group the header validly names,
    as start-up recovery and the inspector read it)."""
    if len(header) < HEADER_BYTES:
        raise IntegrityError(IntegrityReason.SIZE, f"{len(header)} header bytes")
    magic, version, _, length, digest, stored_key, check, stored_group, more = _HEADER.unpack_from(
        header
    )
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
    if stored_group > more or (group is not None and stored_group != group):
        expected = "" if group is None else f", expected group {group}"
        raise IntegrityError(IntegrityReason.GROUP, f"group {stored_group} of {more + 1}{expected}")
    return int(check)


def check_payload(
    payload: bytes | memoryview, payload_bytes: int, expected: int, *, at_most: bool = False
) -> None:
    """Check a payload's size (``payload_bytes``, or with ``at_most`` any size up to
    it) and checksum."""
    if len(payload) > payload_bytes or (len(payload) != payload_bytes and not at_most):
        raise IntegrityError(IntegrityReason.SIZE, f"{len(payload)} of {payload_bytes} bytes")
    if checksum(payload) != expected:
        raise IntegrityError(IntegrityReason.CHECKSUM)


def verify(
    stored: bytes | memoryview,
    format_digest: bytes,
    key: bytes,
    payload_bytes: int,
    *,
    group: int | None = 0,
    at_most: bool = False,
) -> memoryview:
    """The payload of ``stored`` (header + payload) if every field matches (``group``:
    as :func:`check_header`; ``at_most``: a payload of any size up to
    ``payload_bytes``, its header naming that size); else :class:`IntegrityError`.
    Zero-copy: returns a view into ``stored``."""
    view = memoryview(stored)
    payload = view[HEADER_BYTES:]
    size = len(payload) if at_most and len(payload) <= payload_bytes else payload_bytes
    expected = check_header(view[:HEADER_BYTES], format_digest, key, size, group=group)
    check_payload(payload, payload_bytes, expected, at_most=at_most)
    return payload
