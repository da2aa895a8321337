"""The superblock at the start of every disk-tier slab file (4 KiB, little-endian)::

    offset size field
         0    4 magic b"KVOS"
         4    2 format version (1)
         6    2 reserved (0)
         8    4 parallel rank
        12    4 reserved (0)
        16    8 payload bytes per chunk
        24    8 slot bytes (the 4 KiB header block and the page-padded payload)
        32    8 number of slots
        40   16 namespace digest

It makes a slab self-describing: start-up recovery and ``kvoffload inspect`` read
a slab's geometry here instead of guessing it. Pure functions.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAGIC = b"KVOS"
VERSION = 1
SUPERBLOCK_BYTES = 4096
_LAYOUT = struct.Struct("<4sHHIIQQQ16s")


class SuperblockError(ValueError):
    """The first bytes of a file are not a kvoffload slab superblock."""


@dataclass(frozen=True)
class Superblock:
    namespace_digest: bytes
    rank: int
    payload_bytes: int
    num_slots: int

    @property
    def slot_bytes(self) -> int:
        return 4096 + -(-self.payload_bytes // 4096) * 4096

    def encode(self) -> bytes:
        fields = _LAYOUT.pack(
            MAGIC, VERSION, 0, self.rank, 0, self.payload_bytes, self.slot_bytes,
            self.num_slots, self.namespace_digest,
        )  # fmt: skip
        return fields + bytes(SUPERBLOCK_BYTES - len(fields))

    @classmethod
    def decode(cls, data: bytes) -> Superblock:
        if len(data) < _LAYOUT.size:
            raise SuperblockError(f"{len(data)} bytes, not a slab superblock")
        magic, version, _, rank, _, payload, slot, slots, digest = _LAYOUT.unpack_from(data)
        if magic != MAGIC:
            raise SuperblockError("not a kvoffload slab (bad magic)")
        if version != VERSION:
            raise SuperblockError(f"slab format version {version}, this kvoffload reads {VERSION}")
        block = cls(digest, rank, payload, slots)
        if block.slot_bytes != slot:
            raise SuperblockError(f"slot size {slot} does not match payload size {payload}")
        return block
