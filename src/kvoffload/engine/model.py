"""A deterministic stand-in for a transformer, whose outputs depend on the KV it reads.

KV of a token: 8 bytes, ``kv(i) = H(kv(i - 1), token_i)`` chained from a fixed seed,
so each position's KV is a pure function of the tokens up to it (like real KV) and
can be checked byte for byte. The forward pass reads ``kv(start - 1)`` *from the
engine's block* to continue the chain, and samples the next token from a digest of
*every* context position read from the blocks, so a wrong byte anywhere in the
context (a bad load, an overwritten block) changes the output tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

KV_BYTES = 8
SEED = b"kvoffload-reference-model"


def kv_next(prev: bytes, token: int) -> bytes:
    return hashlib.blake2b(prev + token.to_bytes(8, "little"), digest_size=KV_BYTES).digest()


def kv_chain(tokens: Sequence[int], prev: bytes = SEED) -> bytes:
    """KV bytes of every position of ``tokens`` (continuing from ``prev``)."""
    out = bytearray()
    for token in tokens:
        prev = kv_next(prev, token)
        out += prev
    return bytes(out)


def sample(context_kv: bytes, vocab: int) -> int:
    """The next token given the KV bytes of every context position."""
    digest = hashlib.blake2b(context_kv, digest_size=8).digest()
    return 3 + int.from_bytes(digest, "little") % (vocab - 3)


def reference_outputs(prompt: Sequence[int], max_tokens: int, vocab: int) -> list[int]:
    """What the engine must generate for ``prompt``: the oracle for output equality."""
    tokens = list(prompt)
    kv = bytearray(kv_chain(tokens))
    out: list[int] = []
    while len(out) < max_tokens:
        token = sample(bytes(kv), vocab)
        out.append(token)
        kv += kv_next(bytes(kv[-KV_BYTES:]), token)
        tokens.append(token)
    return out
