"""The ``lossless`` chunk codec: byte planes shuffled, then zstd, by blosc2 (issue 33,
decision 0023). Bit-exact.

KV values of one dtype keep most of their entropy in the low mantissa bytes and little
in the high byte (sign and exponent): shuffling groups each byte plane, and the
entropy coder then shrinks the exponent plane. Measured on the demo model's KV
(``bench/codecs.py``): 1.45x for bfloat16, 1.18x for float16 and float32, at 0.6-1.6
GB/s encode and 1.8-3.5 GB/s decode on one core of this machine; lz4 in place of
zstd gains nothing on 16-bit KV.

Encoded: a blosc2 frame (its own header: sizes, type size, no checksum). Decoding
bytes that are not a frame this codec wrote raises :class:`CorruptChunk` (the reader
counts a miss). blosc2 does not notice most changed bytes of a frame (a flipped bit
usually decodes to other bytes), so a slot keeps the frame's checksum beside it
(``chunk_codec.py``, :mod:`.frame_check`), checked before this decodes.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from kvoffload.codecs.frame_check import CorruptChunk

__all__ = ["CLEVEL", "CorruptChunk", "available", "decode", "encode"]

CLEVEL = 1


def available() -> bool:
    """Whether blosc2 is installed (the ``codecs`` extra)."""
    return importlib.util.find_spec("blosc2") is not None


def _params(typesize: int, threads: int) -> dict[str, Any]:
    import blosc2

    return {
        "codec": blosc2.Codec.ZSTD,
        "clevel": CLEVEL,
        "typesize": typesize,
        "nthreads": threads,
        "filters": [blosc2.Filter.SHUFFLE],
    }


def encode(raw: bytes | bytearray | memoryview, typesize: int, threads: int = 1) -> bytes:
    """``raw`` (values of ``typesize`` bytes each) encoded."""
    import blosc2

    out: bytes = blosc2.compress2(raw, **_params(typesize, threads))
    return out


def decode(data: bytes | bytearray | memoryview, expected: int, threads: int = 1) -> bytes:
    """The bytes :func:`encode` encoded; :class:`CorruptChunk` unless they are
    ``expected`` bytes long and ``data`` is a frame that decodes."""
    import blosc2

    try:
        out = blosc2.decompress2(data, nthreads=threads)
    except Exception as exc:  # blosc2 raises RuntimeError/ValueError for bad frames
        raise CorruptChunk(f"lossless: not a chunk this codec wrote ({exc})") from exc
    if not isinstance(out, bytes | bytearray) or len(out) != expected:
        raise CorruptChunk(f"lossless: decoded {len(out)} bytes, expected {expected}")
    return bytes(out)
