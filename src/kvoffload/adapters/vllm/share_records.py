"""A chunk's announcement record: what any engine attached to a node share needs to
publish vLLM's ``BlockStored`` for a chunk another engine stored (issue 34, decision
0022). The share's node process keeps it as opaque bytes (``share/feed.py``).

Format: msgpack (vLLM's own event encoding library, msgspec) of a
:class:`ChunkRecord` as an array: format version, the chunk's parent chain key, its
vLLM block hashes, the hash before them, its token ids (little-endian int64), its KV
cache group, the blocks' extra keys, the LoRA adapter (id, name) and the session id,
as the storing engine's events carry them.

Decoding trusts nothing: :func:`decode` answers None (the caller counts it) for bytes
that are not a record of this format, a record of another geometry (block count,
tokens per block, group), or one whose hashes do not give the key it is announced
under (``next_key`` of its parent key and its hashes, then the group's key): a record
is only ever published for the chunk it describes.
"""

from __future__ import annotations

from array import array
from typing import Any

import msgspec

from kvoffload.core.keys import ChunkKey, next_key
from kvoffload.core.kv_groups import KVGroups

FORMAT = 1
MAX_HASH_BYTES = 64


class ChunkRecord(msgspec.Struct, array_like=True, frozen=True):
    """One chunk's record (see the module docstring)."""

    version: int
    parent_key: bytes
    hashes: list[bytes]
    parent_hash: bytes | None
    tokens: bytes
    group: int
    extra_keys: list[list[Any] | None] | None
    lora: tuple[int, str] | None
    session_id: str | None

    def token_ids(self) -> list[int]:
        return array("q", self.tokens).tolist()


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(ChunkRecord)


def encode(record: ChunkRecord) -> bytes:
    return _ENCODER.encode(record)


def decode(
    data: bytes, key: ChunkKey, groups: KVGroups, hashes_per_chunk: int, hash_tokens: int
) -> ChunkRecord | None:
    """The record in ``data`` if it is a valid record of chunk ``key`` for an engine
    of this geometry (see the module docstring); else None. Never raises."""
    try:
        record = _DECODER.decode(data)
    except (msgspec.DecodeError, ValueError, TypeError):
        return None
    if (
        record.version != FORMAT
        or len(record.hashes) != hashes_per_chunk
        or len(record.tokens) != 8 * hashes_per_chunk * hash_tokens
        or not 0 <= record.group < len(groups)
        or len(record.parent_key) != len(key)
        or any(not 0 < len(h) <= MAX_HASH_BYTES for h in record.hashes)
        or (record.extra_keys is not None and len(record.extra_keys) != hashes_per_chunk)
    ):
        return None
    if groups.key(next_key(ChunkKey(record.parent_key), record.hashes), record.group) != key:
        return None
    return record
