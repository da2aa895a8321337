"""Chunk keys: chained prefix digests bound to a namespace and a cache salt.

A *chunk* is ``chunk_tokens`` consecutive tokens of a request (``blocks_per_chunk``
engine blocks). Its *key* names the whole prefix up to and including the chunk, so a
hit on key ``i`` implies the request's first ``i + 1`` chunks are all known.

Two layers of hashing, both BLAKE2b-128 (deterministic across processes and
machines; never Python's ``hash()``):

1. **Block hashes** (engine level): ``b_j = H(b_{j-1}, tokens of block j)`` seeded by
   the cache salt. vLLM computes an equivalent chain itself (``request.block_hashes``,
   already salted); :func:`block_hashes` is kvoffload's own, used by the reference
   engine and for token-derived keys.
2. **Chunk keys** (kvoffload level): ``k_i = H(k_{i-1}, block hashes of chunk i)``
   seeded by the namespace digest.

So ``keys_from_tokens`` is exactly ``keys_from_block_hashes`` over ``block_hashes``:
one definition, two entry points. Two namespaces or two salts give different seeds
and therefore disjoint key chains (up to a 2^-128 collision).

Nothing here is mutable except :class:`KeyChain`, which is owned by one request.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NewType

from kvoffload.core.errors import ConfigError

ChunkKey = NewType("ChunkKey", bytes)
"""16 bytes naming a chunk and, through the chain, its whole prefix."""

KEY_BYTES = 16
_KEY_FORMAT = b"kvoffload/chunk-key/v1"
_BLOCK_FORMAT = b"kvoffload/block-hash/v1"
_SHARD_FORMAT = b"kvoffload/shard-key/v1"
_NS_FORMAT = b"kvoffload/namespace/v1"
_EPOCH_FORMAT = b"kvoffload/epoch/v1"
_EXTRA_FORMAT = b"kvoffload/request-extra/v1"


def _lp(data: bytes) -> bytes:
    """Length-prefix ``data`` so that concatenations are unambiguous."""
    return len(data).to_bytes(4, "little") + data


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for part in parts:
        h.update(part)
    return h.digest()


def _salt_bytes(salt: str | bytes | None) -> bytes:
    if salt is None:
        return b"\x00"
    raw = salt.encode() if isinstance(salt, str) else bytes(salt)
    return b"\x01" + _lp(raw)


def tokens_bytes(tokens: Sequence[int]) -> bytes:
    """Little-endian int64 encoding of token ids (machine independent)."""
    arr = array("q", tokens)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


@dataclass(frozen=True)
class Namespace:
    """What a chunk's bytes mean: which model, which KV layout, which dtype.

    ``model`` is ``name@revision``. ``config`` digests the model configuration that
    reaches the forward pass (the model's config after overrides, quantization, model
    and KV cache dtypes) and ``weights`` the weights' identity (a hub revision's
    commit, or a digest of a local directory's weight files); both are hex strings
    built by the vLLM adapter (``adapters/vllm/identity.py``, decision 0010), empty
    where the engine has no such thing (reference engine, simulator). ``layout`` is
    the worker's layout digest (shapes, page bytes, layer count), so a chunk is never
    loaded into an incompatible layout. ``parallel`` describes the parallel
    configuration (e.g. ``"tp2"``); the scheduler half holds one key per chunk for
    all ranks, and each rank's copy in a shared tier is told apart by
    :func:`shard_key`.

    The digest covers every field. With ``config`` and ``weights`` both empty it is
    the digest of the first four fields alone, as before those fields existed.
    """

    model: str
    layout: str
    dtype: str
    parallel: str = "tp1"
    config: str = ""
    weights: str = ""
    _digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("model", "layout", "dtype", "parallel"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ConfigError(f"namespace.{name}", f"must be a non-empty string, got {value!r}")
        for name in ("config", "weights"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ConfigError(f"namespace.{name}", f"must be a string, got {value!r}")
        values = [self.model, self.layout, self.dtype, self.parallel]
        if self.config or self.weights:
            values += [self.config, self.weights]
        encoded = b"".join(_lp(v.encode()) for v in values)
        object.__setattr__(self, "_digest", _digest(_NS_FORMAT, encoded))

    def digest(self) -> bytes:
        """16-byte digest of every field; stored in tier headers."""
        return self._digest

    def fields(self) -> dict[str, str]:
        """Every field by name (what ``kvoffload inspect`` shows of a namespace)."""
        return {
            "model": self.model,
            "config": self.config,
            "weights": self.weights,
            "layout": self.layout,
            "dtype": self.dtype,
            "parallel": self.parallel,
        }


def block_hashes(
    tokens: Sequence[int],
    block_size: int,
    salt: str | bytes | None = None,
    parent: bytes | None = None,
) -> list[bytes]:
    """Salted chained hashes of every *full* block of ``tokens``.

    ``parent`` continues an existing chain (the hash of the block before
    ``tokens[0]``); without it the chain is seeded by the salt. A trailing partial
    block gets no hash.
    """
    if block_size <= 0:
        raise ConfigError("block_size", f"must be a positive integer, got {block_size!r}")
    prev = parent if parent is not None else _digest(_BLOCK_FORMAT, _salt_bytes(salt))
    out: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        prev = _digest(prev, tokens_bytes(tokens[start : start + block_size]))
        out.append(prev)
    return out


def chain_seed(namespace: Namespace, epoch: bytes = b"", extra: bytes = b"") -> ChunkKey:
    """The key 'before' chunk 0 of every request in ``namespace``.

    ``epoch`` names the weights and connector-reset generation the KV was computed
    under (decisions 0005 and 0019): chains of another epoch are disjoint, so chunks
    stored under other weights, or before a reset, are never found. ``extra`` is what
    the request itself adds to its KV's identity beyond vLLM's block hashes (the
    content digest of its LoRA adapter). Both empty give the format's original seed."""
    parts = [_KEY_FORMAT, namespace.digest()]
    if epoch:
        parts += [_EPOCH_FORMAT, _lp(epoch)]
    if extra:
        parts += [_EXTRA_FORMAT, _lp(extra)]
    return ChunkKey(_digest(*parts))


def next_key(prev: ChunkKey, chunk_block_hashes: Sequence[bytes]) -> ChunkKey:
    """The key of the chunk whose engine blocks have ``chunk_block_hashes``: the
    digest of ``prev`` and each hash length-prefixed (built in one buffer: this runs
    for every chunk of every request)."""
    parts: list[bytes] = [prev]
    for h in chunk_block_hashes:
        raw = bytes(h)
        parts.append(len(raw).to_bytes(4, "little"))
        parts.append(raw)
    return ChunkKey(hashlib.blake2b(b"".join(parts), digest_size=KEY_BYTES).digest())


def keys_from_block_hashes(
    namespace: Namespace, hashes: Sequence[bytes], blocks_per_chunk: int
) -> list[ChunkKey]:
    """Keys of every full chunk covered by an engine's block-hash chain."""
    chain = KeyChain(namespace, blocks_per_chunk)
    chain.extend(hashes)
    return list(chain.keys)


def keys_from_tokens(
    namespace: Namespace,
    tokens: Sequence[int],
    chunk_tokens: int,
    block_size: int,
    salt: str | bytes | None = None,
) -> list[ChunkKey]:
    """Keys of every full chunk of ``tokens`` (salted block hashes, then chunk keys)."""
    if chunk_tokens <= 0 or chunk_tokens % block_size:
        raise ConfigError(
            "chunk_tokens",
            f"must be a positive multiple of the block size {block_size}, got {chunk_tokens!r}",
        )
    return keys_from_block_hashes(
        namespace, block_hashes(tokens, block_size, salt), chunk_tokens // block_size
    )


def shard_key(key: ChunkKey, rank: int) -> ChunkKey:
    """The key of one parallel rank's share of a chunk, for tiers shared by ranks."""
    return ChunkKey(_digest(_SHARD_FORMAT, key, rank.to_bytes(4, "little")))


class KeyChain:
    """The append-only list of one request's chunk keys.

    Owned by the request's state in the scheduler half. :meth:`extend` is fed the
    request's full block-hash list (which only grows) and hashes only the chunks it
    has not seen, so the cost per engine step is proportional to new chunks.
    """

    __slots__ = ("_blocks_seen", "_last", "blocks_per_chunk", "extra", "keys", "seed")

    def __init__(
        self, namespace: Namespace, blocks_per_chunk: int, epoch: bytes = b"", extra: bytes = b""
    ) -> None:
        if blocks_per_chunk <= 0:
            raise ConfigError(
                "blocks_per_chunk", f"must be a positive integer, got {blocks_per_chunk!r}"
            )
        self.blocks_per_chunk = blocks_per_chunk
        self.extra = extra
        self.keys: list[ChunkKey] = []
        self.seed = chain_seed(namespace, epoch, extra)  # the key before chunk 0
        self._last = self.seed
        self._blocks_seen = 0

    def extend(self, all_block_hashes: Sequence[bytes]) -> list[ChunkKey]:
        """Hash the chunks completed since the last call; return the full key list."""
        bpc = self.blocks_per_chunk
        while self._blocks_seen + bpc <= len(all_block_hashes):
            start = self._blocks_seen
            self._last = next_key(self._last, all_block_hashes[start : start + bpc])
            self.keys.append(self._last)
            self._blocks_seen += bpc
        return self.keys
