"""Chunk codecs (issue 33): how a chunk's bytes are kept in a tier.

- ``none``: as the engine's KV layout has them;
- ``lossless`` (:mod:`.lossless`): byte planes shuffled, then zstd; bit-exact;
- ``fp8`` (:mod:`.fp8`): e4m3 with a float32 scale per run of elements; lossy.

This package holds the codecs themselves and their measured properties
(``bench/codecs.py``, decision 0023). The engine's store and load paths do not use
them yet: the per-tier ``codec`` option, the slabs' variable-size chunks and the
checks of every tier come with the rest of issue 33.
"""

from __future__ import annotations

CODECS = ("none", "lossless", "fp8")
FP8_RUN = 4096
"""Elements per fp8 scale (one float32 each): 0.1% of the encoded bytes."""


def fp8_ratio(dtype_bytes: int, run: int = FP8_RUN) -> float:
    """How many times smaller fp8 makes KV of ``dtype_bytes`` per element (2 or 4);
    ``ValueError`` for 8-bit KV (already as small as fp8 makes it)."""
    if dtype_bytes not in (2, 4):
        raise ValueError(f"fp8 encodes 16- and 32-bit KV, not {8 * dtype_bytes}-bit")
    return dtype_bytes * run / (run + 4)
