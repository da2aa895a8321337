"""Announcement records are checked in full (``share_records.py``): a record is only
valid when its token ids, parent hash and extra keys give the hashes it claims with the
reading engine's block hasher, its LoRA name is the one its keys hashed, its root is
the reader's and its hashes lead to the key it is announced under. Here with a
stand-in hasher (sha256 over the repr of vLLM's inputs); the vLLM hasher's own tests
are in ``tests/vllm/test_share_announcer.py``."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import msgspec

from kvoffload.adapters.vllm.share_records import (
    FORMAT,
    BlockKeys,
    ChunkRecord,
    decode,
    encode,
)
from kvoffload.core.keys import ChunkKey, next_key
from kvoffload.core.kv_groups import ONE_GROUP

BLOCK = 4  # tokens per hash block
PER_CHUNK = 2  # hash blocks per chunk
PARENT_KEY = ChunkKey(bytes(16))
LORA = ("lora", "adapter-a", "/adapters/a")


class Hasher:
    """A block hash of the same inputs as vLLM's, with another function."""

    def __init__(self, root: bytes = b"root-1") -> None:
        self._root = root

    def block(self, parent: bytes | None, tokens: Sequence[int], keys: BlockKeys) -> bytes:
        start = parent or b"first:" + self._root
        return hashlib.sha256(repr((start, tuple(tokens), keys)).encode()).digest()

    def root(self) -> bytes | None:
        return self._root


def chunk(
    tokens: list[int],
    keys: tuple[BlockKeys, ...] | None = None,
    parent: bytes | None = None,
    hasher: Hasher | None = None,
) -> list[bytes]:
    """The hashes of a chunk's blocks, as the storing engine computed them."""
    hasher = hasher or Hasher()
    hashes = []
    for i in range(PER_CHUNK):
        block = tokens[i * BLOCK : (i + 1) * BLOCK]
        parent = hasher.block(parent, block, None if keys is None else keys[i])
        hashes.append(parent)
    return hashes


def record(
    hashes: list[bytes],
    tokens: list[int],
    keys: tuple[BlockKeys, ...] | None = None,
    *,
    parent: bytes | None = None,
    lora: tuple[int, str] | None = None,
    root: bytes = b"root-1",
    version: int = FORMAT,
) -> bytes:
    tokens_bytes = b"".join(t.to_bytes(8, "little", signed=True) for t in tokens)
    return encode(
        ChunkRecord(
            version, PARENT_KEY, hashes, parent, tokens_bytes, 0,
            None if keys is None else list(keys), lora, "session-1", root,
        )
    )  # fmt: skip


def key_of(hashes: list[bytes]) -> ChunkKey:
    return ONE_GROUP.key(next_key(PARENT_KEY, hashes), 0)


def read(data: bytes, hashes: list[bytes], hasher: Hasher | None = None) -> ChunkRecord | None:
    return decode(data, key_of(hashes), ONE_GROUP, PER_CHUNK, BLOCK, hasher=hasher or Hasher())


TOKENS = list(range(1, 1 + PER_CHUNK * BLOCK))
OTHER = list(range(100, 100 + PER_CHUNK * BLOCK))


def test_a_record_of_its_chunk_is_read_back() -> None:
    hashes = chunk(TOKENS)
    got = read(record(hashes, TOKENS), hashes)
    assert got is not None and got.token_ids() == TOKENS and got.hashed_keys() is None


def test_a_record_with_the_right_hashes_and_another_prefixs_tokens_is_refused() -> None:
    hashes = chunk(TOKENS)
    assert read(record(hashes, OTHER), hashes) is None
    swapped = TOKENS[BLOCK:] + TOKENS[:BLOCK]  # the same tokens, blocks swapped
    assert read(record(hashes, swapped), hashes) is None


def test_a_record_with_another_parent_hash_is_refused() -> None:
    parent = b"p" * 32
    hashes = chunk(TOKENS, parent=parent)
    assert read(record(hashes, TOKENS, parent=parent), hashes) is not None
    assert read(record(hashes, TOKENS, parent=b"q" * 32), hashes) is None
    assert read(record(hashes, TOKENS), hashes) is None  # claimed to be a first chunk


def test_extra_keys_and_lora_must_be_the_ones_hashed() -> None:
    keys = ((LORA, ("cache_salt", "tenant-x")), (LORA,))
    hashes = chunk(TOKENS, keys)
    got = read(record(hashes, TOKENS, keys, lora=(7, "adapter-a")), hashes)
    assert got is not None and got.hashed_keys() == keys
    # Another salt, no keys at all, or another adapter's name published.
    salted = ((LORA, ("cache_salt", "tenant-y")), (LORA,))
    assert read(record(hashes, TOKENS, salted, lora=(7, "adapter-a")), hashes) is None
    assert read(record(hashes, TOKENS, None, lora=(7, "adapter-a")), hashes) is None
    assert read(record(hashes, TOKENS, keys, lora=(7, "adapter-b")), hashes) is None
    assert read(record(hashes, TOKENS, keys, lora=None), hashes) is None


def test_a_lora_name_without_lora_keys_is_refused() -> None:
    hashes = chunk(TOKENS)
    assert read(record(hashes, TOKENS, lora=(7, "adapter-a")), hashes) is None


def test_a_record_of_another_root_or_without_a_hasher_is_refused() -> None:
    """Engines whose first blocks chain from another hash compute other keys: their
    records (even of later chunks, whose parent hash is explicit) are not announced."""
    other = Hasher(b"root-2")
    parent = b"p" * 32
    hashes = chunk(TOKENS, parent=parent, hasher=other)
    data = record(hashes, TOKENS, parent=parent, root=b"root-2")
    assert read(data, hashes, other) is not None
    assert read(data, hashes) is None
    assert decode(data, key_of(hashes), ONE_GROUP, PER_CHUNK, BLOCK, hasher=None) is None


def test_records_of_another_format_key_or_shape_are_refused() -> None:
    hashes = chunk(TOKENS)
    assert read(record(hashes, TOKENS, version=1), hashes) is None
    assert read(record(hashes, TOKENS), chunk(OTHER)) is None  # another chunk's key
    assert read(record(hashes, TOKENS[:-1]), hashes) is None
    assert read(record(hashes, TOKENS, (None,)), hashes) is None  # one entry per block
    assert read(b"\x93\x01\x02\x03", hashes) is None
    odd = msgspec.msgpack.encode([FORMAT, bytes(16), hashes, None, b"", 0, ["x"], None, None, b""])
    assert read(odd, hashes) is None


def test_keys_the_hasher_cannot_take_are_refused_never_raised() -> None:
    class Picky(Hasher):
        def block(self, parent: bytes | None, tokens: Sequence[int], keys: BlockKeys) -> bytes:
            raise TypeError("unhashable")

    hashes = chunk(TOKENS)
    assert read(record(hashes, TOKENS), hashes, Picky()) is None
