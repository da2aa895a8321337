"""The checksum every codec frame carries (issue 41): xxh3-64 of the bytes the codec
wrote, kept in the frame's header and checked before a byte of it is decoded.

Why here and not only in the tiers: disk and Redis checksum the bytes they store,
but host memory and the node-shared slabs (which every process of a
``host_share_group`` may write) keep a slot's bytes with no check of their own, and a
codec's output does not notice a flipped bit: 27,013 of 27,928 single-bit flips of a
blosc2 frame decoded to other bytes, and a flipped bit of an fp8 scale or value always
decodes to another value. With the check, a slot that is not what the codec wrote
fails its decode (:class:`CorruptChunk`, a ``ValueError``): the load fails, and the
engine recomputes those blocks; a lower tier counts it as ``integrity:codec``.

Where the 8 bytes go (``codecs/chunk_codec.py``): a lossless slot's header is the
frame length then the checksum of the frame (the slot's 64 bytes of slack hold
them: slots keep their size); an fp8 chunk starts with the checksum of its scales
and values (8 bytes more per chunk).

What it is not: a MAC. Anyone who can write a slot can write a matching checksum;
it catches corruption (a flipped bit, a torn or misdirected write, a slot written by
mistake), not forgery. Processes of the same user are trusted (the design's security
model); what leaves the machine is sealed by the tiers.

Pure: xxhash only (no torch, no compression library), imported when a checksum is
first computed: ``scripts/gpu-check`` runs the fp8 codec with torch and numpy alone
and gives its codec another :data:`Digest` where xxhash is not installed.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from kvoffload.codecs import FRAME_CHECK_BYTES

_CHECK = struct.Struct("<Q")
assert _CHECK.size == FRAME_CHECK_BYTES

Digest = Callable[[memoryview], int]
"""A checksum function: bytes to an unsigned 64-bit integer."""


class CorruptChunk(ValueError):
    """Encoded bytes that do not decode: not a frame this codec wrote, or one whose
    bytes changed since."""


def xxh3(payload: memoryview) -> int:
    """The checksum of ``payload`` in kvoffload's frames: xxh3-64."""
    import xxhash

    return xxhash.xxh3_64_intdigest(payload)


def seal(slot: memoryview, at: int, payload: memoryview, digest: Digest = xxh3) -> None:
    """Write the checksum of ``payload`` into ``slot[at : at + 8]`` (little-endian)."""
    _CHECK.pack_into(slot, at, digest(payload))


def check(
    slot: memoryview, at: int, payload: memoryview, codec: str, digest: Digest = xxh3
) -> None:
    """``CorruptChunk`` unless ``slot[at : at + 8]`` is the checksum of ``payload``."""
    (stored,) = _CHECK.unpack_from(slot, at)
    if stored != digest(payload):
        raise CorruptChunk(f"{codec}: the frame's checksum does not match its bytes")
