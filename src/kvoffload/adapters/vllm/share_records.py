"""A chunk's announcement record: what any engine attached to a node share needs to
publish vLLM's ``BlockStored`` for a chunk another engine stored (issue 34, decision
0022), and what a restarted engine needs to announce its own persistent chunks (the
record logs). The share's node process keeps it as opaque bytes (``share/feed.py``).

Format: msgpack (vLLM's own event encoding library, msgspec) of a
:class:`ChunkRecord` as an array: format version, the chunk's parent chain key, its
vLLM block hashes, the hash before them (None for a prompt's first chunk), its token
ids (little-endian int64), its KV cache group, each hash block's extra keys *as vLLM's
block hasher hashed them* (tagged: ``("lora", name, path)``, ``("mm", identifier,
offset)``, ``("cache_salt", salt)``, ``("prompt_embeds", digest)``; the event form
routers receive is derived from them, vLLM's ``to_event_extra_keys``), the LoRA adapter
(id, name), the session id, and the storing engine's *root*: a digest of the hash vLLM
chains a prompt's first block from (``NONE_HASH``), :meth:`RecordHasher.root`.

Decoding trusts nothing: :func:`decode` answers None (the caller counts it) for

- bytes that are not a record of this format (records of format 1, written before the
  check below existed, included: their chunks are still served, not announced);
- a record of another geometry (block count, tokens per block, group);
- a record whose hashes do not give the key it is announced under (``next_key`` of its
  parent key and its hashes, then the group's key);
- a record whose hashes are not the ones its token ids, parent hash and extra keys give
  through the reading engine's block hasher (vLLM's ``hash_block_tokens`` with the
  engine's ``prefix_caching_hash_algo``, :class:`RecordHasher`): a record with a
  chunk's hashes and another prefix's tokens, LoRA or salt is never published, so a
  router that indexes token ids never credits an engine with a prefix it cannot serve;
- a record whose LoRA name is not the one its extra keys hashed (the adapter id and the
  session id are not part of vLLM's hashes: they are published as the record says);
- a record of another root. Engines whose vLLM block hashes start from another
  ``NONE_HASH`` (a non-cryptographic ``prefix_caching_hash_algo`` without one
  ``PYTHONHASHSEED`` for all; vLLM then draws it per process) compute other keys for
  the same tokens and can never load each other's chunks: a record of such an engine,
  or of this engine before a restart that drew another one, is not announced. With
  vLLM's default ``sha256`` every engine has the same root.

A record is thus only ever published for the chunk it describes, as this engine would
hash it. The hasher is passed in (the vLLM adapter's is ``block_hasher.py``), so this
module stays free of vLLM and is tested with any hash.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any, Protocol

import msgspec

from kvoffload.core.keys import ChunkKey, next_key
from kvoffload.core.kv_groups import KVGroups

FORMAT = 2
MAX_HASH_BYTES = 64

BlockKeys = tuple[Any, ...] | None
"""One hash block's extra keys as vLLM's block hasher takes them (None: none)."""


class RecordHasher(Protocol):
    """vLLM's block hash as the reading engine computes it."""

    def block(self, parent: bytes | None, tokens: Sequence[int], keys: BlockKeys) -> bytes:
        """The hash of a block of ``tokens`` with extra ``keys`` after ``parent`` (None:
        the first block of a prompt). May raise for input it cannot hash."""

    def root(self) -> bytes | None:
        """The digest of the hash a prompt's first block is chained from (None: not
        known yet: no record verifies)."""


class ChunkRecord(msgspec.Struct, array_like=True, frozen=True):
    """One chunk's record (see the module docstring)."""

    version: int
    parent_key: bytes
    hashes: list[bytes]
    parent_hash: bytes | None
    tokens: bytes
    group: int
    block_keys: list[tuple[tuple[Any, ...], ...] | None] | None  # one entry per hash block
    lora: tuple[int, str] | None
    session_id: str | None
    root: bytes

    def token_ids(self) -> list[int]:
        return array("q", self.tokens).tolist()

    def hashed_keys(self) -> tuple[BlockKeys, ...] | None:
        """The extra keys of each hash block as vLLM's block hasher takes them, or
        None when no block has any. (Each block's keys are a tuple of tuples, as vLLM
        makes them, decoded as such; a deeper array decodes as a list, which hashes
        as no key vLLM makes: such a record never verifies.)"""
        return None if self.block_keys is None else tuple(self.block_keys)


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(ChunkRecord)


def encode(record: ChunkRecord) -> bytes:
    return _ENCODER.encode(record)


def parse(data: bytes) -> ChunkRecord | None:
    """The record in ``data`` as it reads, checked for nothing but its format (bytes
    :func:`decode` accepted before for the same key); None for anything else."""
    try:
        record = _DECODER.decode(data)
    except (msgspec.DecodeError, ValueError, TypeError):
        return None
    return record if record.version == FORMAT else None


def decode(
    data: bytes,
    key: ChunkKey,
    groups: KVGroups,
    hashes_per_chunk: int,
    hash_tokens: int,
    *,
    hasher: RecordHasher | None,
) -> ChunkRecord | None:
    """The record in ``data`` if it is a valid record of chunk ``key`` for an engine
    of this geometry whose block hasher is ``hasher`` (see the module docstring; None:
    no hasher, no record is valid); else None. Never raises."""
    if hasher is None:
        return None
    record = parse(data)
    if record is None:
        return None
    if (
        len(record.hashes) != hashes_per_chunk
        or len(record.tokens) != 8 * hashes_per_chunk * hash_tokens
        or not 0 <= record.group < len(groups)
        or len(record.parent_key) != len(key)
        or any(not 0 < len(h) <= MAX_HASH_BYTES for h in record.hashes)
        or (record.block_keys is not None and len(record.block_keys) != hashes_per_chunk)
    ):
        return None
    if groups.key(next_key(ChunkKey(record.parent_key), record.hashes), record.group) != key:
        return None
    try:
        if record.root != hasher.root() or not _hashes_hold(record, hasher, hash_tokens):
            return None
    except Exception:  # keys a hasher cannot take (e.g. unhashable types): not valid
        return None
    return record


def _hashes_hold(record: ChunkRecord, hasher: RecordHasher, hash_tokens: int) -> bool:
    """Whether the record's token ids, parent hash and extra keys give its hashes, and
    its LoRA name is the one the keys hashed."""
    keys = record.hashed_keys()
    if not _lora_agrees(keys, record.lora):
        return False
    tokens = record.token_ids()
    parent = record.parent_hash
    for i, claimed in enumerate(record.hashes):
        block = tokens[i * hash_tokens : (i + 1) * hash_tokens]
        if hasher.block(parent, block, None if keys is None else keys[i]) != claimed:
            return False
        parent = claimed
    return True


def _lora_agrees(keys: tuple[BlockKeys, ...] | None, lora: tuple[int, str] | None) -> bool:
    """Whether ``lora``'s name is the one the blocks' keys hashed (vLLM's ``("lora",
    name, path)``, once in every block of a LoRA request; no block names one without)."""
    names = [tuple(str(part[1]) for part in block or () if _is_lora(part)) for block in keys or ()]
    if lora is None:
        return not any(names)
    return bool(names) and all(n == (lora[1],) for n in names)


def _is_lora(part: object) -> bool:
    return isinstance(part, tuple) and len(part) >= 2 and part[0] == "lora"
