"""The layout of a sealed chunk, as a tier keeps it (decision 0024).

A sealed chunk is the chunk's bytes (as the tier's codec keeps them) encrypted with
AES-256-GCM behind a 32-byte prefix, with the 16-byte tag after them::

    offset      size  field
         0         4  magic b"KVSL"
         4         2  seal format version (1)
         6         2  reserved (0)
         8         4  key id (which key of the key file sealed it)
        12        12  nonce (random, fresh for every write)
        24         8  plaintext length in bytes
        32         n  ciphertext
      32+n        16  GCM tag

All little-endian. The associated data (authenticated, not stored) is
:func:`associated_data`: a domain string, the whole prefix, and the chunk's context
(:class:`SealContext`: namespace digest, storage key, KV cache group and the layout's
group count, the chunk format version). A value opens only under the key, the chunk
and the namespace it was sealed for: swapped between keys, moved between namespaces,
truncated, extended or with any bit changed, it fails its tag.

Pure data; imports no cipher (the tier builds read :data:`SEAL_BYTES` to size slots).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

MAGIC = b"KVSL"
VERSION = 1
PREFIX_BYTES = 32
TAG_BYTES = 16
NONCE_BYTES = 12
SEAL_BYTES = PREFIX_BYTES + TAG_BYTES
"""What sealing adds to a chunk's bytes."""

_PREFIX = struct.Struct("<4sHHI12sQ")
_DOMAIN = b"kvoffload sealed chunk v1\x00"
_CONTEXT = struct.Struct("<16s16sHHH")

assert _PREFIX.size == PREFIX_BYTES


@dataclass(frozen=True)
class SealContext:
    """What a sealed chunk is bound to besides its key: the namespace's digest
    (model, weights, layout, codecs), the chunk's storage key (its chunk key and
    rank), its KV cache group, the layout's group count and the format version of
    the chunk as the tier stores it."""

    namespace: bytes
    storage_key: bytes
    group: int = 0
    groups: int = 1
    chunk_format: int = 1

    def encode(self) -> bytes:
        return _CONTEXT.pack(
            self.namespace, self.storage_key, self.group, self.groups, self.chunk_format
        )


@dataclass(frozen=True)
class Prefix:
    """A sealed chunk's prefix, as read (unchecked until the tag is)."""

    magic: bytes
    version: int
    key_id: int
    nonce: bytes
    length: int


def encode_prefix(key_id: int, nonce: bytes, length: int) -> bytes:
    if len(nonce) != NONCE_BYTES:
        raise ValueError(f"a nonce is {NONCE_BYTES} bytes")
    return _PREFIX.pack(MAGIC, VERSION, 0, key_id, nonce, length)


def decode_prefix(data: bytes | memoryview) -> Prefix:
    """The prefix of ``data`` (at least :data:`PREFIX_BYTES`, else ``ValueError``)."""
    if len(data) < PREFIX_BYTES:
        raise ValueError(f"{len(data)} bytes: shorter than a sealed chunk's prefix")
    magic, version, _, key_id, nonce, length = _PREFIX.unpack_from(data)
    return Prefix(bytes(magic), int(version), int(key_id), bytes(nonce), int(length))


def associated_data(prefix: bytes | memoryview, context: SealContext) -> bytes:
    """What a chunk's tag authenticates besides its ciphertext."""
    return b"".join((_DOMAIN, bytes(prefix[:PREFIX_BYTES]), context.encode()))


def sealed_size(length: int) -> int:
    """The bytes a chunk of ``length`` bytes takes sealed."""
    return length + SEAL_BYTES
