"""vLLM's block hash as this engine computes it, for checking announcement records
(``share_records.py``).

:class:`VllmBlockHasher` hashes a block as vLLM's request block hasher does
(``hash_block_tokens`` with the hash function of the engine's
``prefix_caching_hash_algo``), and names the hash a prompt's first block is chained
from (vLLM's ``NONE_HASH``) by a digest, the records' *root*.

``NONE_HASH`` is set by vLLM's engine core after it built the scheduler (and so this
connector). It is derived from ``PYTHONHASHSEED`` when that is set, else from a fixed
seed for the cryptographic hashes (``sha256``, ``sha256_cbor``): both known before
vLLM sets it, so records recovered at start-up are checked with the right one. With a
non-cryptographic hash (``xxhash``, ``xxhash_cbor``) and no ``PYTHONHASHSEED`` vLLM
draws it at random per process: it is known only once vLLM set it (until then no
record verifies, and none of an earlier process ever does: their keys are not this
process's). The root is a digest, so records never reveal ``NONE_HASH`` itself (vLLM
keeps a random one secret: it is what makes its non-cryptographic hashes hard to
collide).

Stateless but for the hash function; any thread.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from typing import Any

from kvoffload.adapters.vllm.compat import get_hash_fn_by_name, hash_block_tokens, kv_cache_utils
from kvoffload.adapters.vllm.share_records import BlockKeys

_RANDOM_WITHOUT_SEED = frozenset({"xxhash", "xxhash_cbor"})
"""vLLM's hash functions whose ``NONE_HASH`` is drawn per process without
``PYTHONHASHSEED``."""


class VllmBlockHasher:
    """One engine's vLLM block hash (see the module docstring). Raises ValueError for
    a hash algorithm vLLM does not know (vLLM refused it at start-up before)."""

    def __init__(self, algo: str) -> None:
        self.algo = algo
        self._fn: Callable[[Any], bytes] = get_hash_fn_by_name(algo)
        self._derived: tuple[str, bytes, bytes] | None = None  # (seed, none hash, root)

    def none_hash(self) -> bytes | None:
        """The hash vLLM chains a prompt's first block from (None: not drawn yet)."""
        seed = os.environ.get("PYTHONHASHSEED")
        if seed is None and self.algo in _RANDOM_WITHOUT_SEED:
            drawn = getattr(kv_cache_utils, "NONE_HASH", None)
            return None if drawn is None else bytes(drawn)
        return self._derive(seed if seed is not None else kv_cache_utils.DEFAULT_NONE_HASH_SEED)[0]

    def block(self, parent: bytes | None, tokens: Sequence[int], keys: BlockKeys) -> bytes:
        """vLLM's hash of a block of ``tokens`` with extra ``keys`` after ``parent``
        (None: a prompt's first block)."""
        if not parent:
            parent = self.none_hash()
            if parent is None:
                raise LookupError("vLLM has not drawn its first-block hash yet")
        return bytes(hash_block_tokens(self._fn, kv_cache_utils.BlockHash(parent), tokens, keys))

    def root(self) -> bytes | None:
        """A digest of :meth:`none_hash` (None: not drawn yet)."""
        none_hash = self.none_hash()
        if none_hash is None:
            return None
        if self._derived is not None and self._derived[1] == none_hash:
            return self._derived[2]
        return _root(none_hash)

    def _derive(self, seed: str) -> tuple[bytes, bytes]:
        """(none hash, root) of ``seed``, as vLLM derives the first from it; the
        last seed's remembered."""
        if self._derived is None or self._derived[0] != seed:
            none_hash = bytes(self._fn(seed))
            self._derived = (seed, none_hash, _root(none_hash))
        return self._derived[1], self._derived[2]


def _root(none_hash: bytes) -> bytes:
    return hashlib.sha256(b"kvoffload/record-root\x00" + none_hash).digest()[:16]
