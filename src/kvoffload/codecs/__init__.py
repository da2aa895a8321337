"""Chunk codecs (issue 33, decision 0023): how a chunk's bytes are kept in a tier.

- ``none``: as the engine's KV layout has them;
- ``lossless`` (:mod:`.lossless`): byte planes shuffled, then zstd; bit-exact;
- ``fp8`` (:mod:`.fp8`): e4m3 with a float32 scale per run of elements; lossy.

This package holds the codecs, their size rules and what a worker runs of them
(:mod:`.chunk_codec`), the checksum every frame carries (:mod:`.frame_check`), and
the per-tier codec options (:func:`tier_codec_option`). Importing it imports neither
torch nor a compression library.
"""

from __future__ import annotations

from typing import Any

from kvoffload.core.config.sections import Option

CODECS = ("none", "lossless", "fp8")
FP8_RUN = 4096
"""Elements per fp8 scale (one float32 each): 0.1% of the encoded bytes."""
FRAME_CHECK_BYTES = 8
"""The checksum (xxh3-64) in every codec frame's header (:mod:`.frame_check`)."""
LOSSLESS_OVERHEAD = 64
"""Bytes a lossless slot holds beyond the raw chunk: the 8-byte frame length, the
frame's checksum and blosc2's own header (at most 32 bytes), rounded up
(``chunk_codec.py``)."""


def fp8_ratio(dtype_bytes: int, run: int = FP8_RUN) -> float:
    """How many times smaller fp8 makes KV of ``dtype_bytes`` per element (2 or 4);
    ``ValueError`` for 8-bit KV (already as small as fp8 makes it)."""
    if dtype_bytes not in (2, 4):
        raise ValueError(f"fp8 encodes 16- and 32-bit KV, not {8 * dtype_bytes}-bit")
    return dtype_bytes * run / (run + 4)


def _codec_or_unset(v: Any) -> bool:
    return v is None or v in CODECS


def tier_codec_option(tier: str) -> Option:
    """The option ``<tier>_codec``: tier ``tier``'s codec when it differs from
    ``codec`` (unset: ``codec``)."""
    return Option(
        f"{tier}_codec",
        "none | lossless | fp8 (unset: codec)",
        None,
        f"How the {tier} tier keeps chunks, when it differs from codec (e.g. host memory "
        "none and the lower tiers fp8). Chunks are re-encoded when they move between "
        "tiers of different codecs (decision 0023).",
        _codec_or_unset,
    )
