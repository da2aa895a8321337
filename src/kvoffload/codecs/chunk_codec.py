"""A chunk codec as the transfer worker uses it: one rank's chunk of ``raw_bytes``
(its block records, as :mod:`kvoffload.transfer.layout` lays them out) kept in a tier
slot of ``stored_bytes`` (issue 33).

:func:`stored_bytes` is the pure size rule (the geometry sizes each tier with it);
:func:`open_codec` builds the codec a worker runs (``none``: no codec object, a slot
holds the records). Every codec has the same contract (:class:`ChunkCodec`):
``encode`` writes the first :meth:`~ChunkCodec.used_bytes` of the stored slot
(fp8: all of it) and raises ``ValueError`` for a chunk it cannot encode (nothing
then counts as written); ``decode`` fills the whole raw chunk and raises
``ValueError`` (:class:`~kvoffload.codecs.lossless.CorruptChunk`) for bytes it did
not write.

``lossless`` frames: a slot of ``raw_bytes`` + :data:`LOSSLESS_OVERHEAD` holds an
8-byte little-endian frame length, then the blosc2 frame (blosc2 stores a chunk it
cannot shrink as it is, with at most 32 bytes of its own header), then unused bytes.
A tier keyed by chunk (Redis) stores only the used bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

import torch

from kvoffload.codecs import FP8_RUN, LOSSLESS_OVERHEAD, fp8, lossless
from kvoffload.core.errors import ConfigError

KV_DTYPES = {2: (torch.bfloat16, torch.float16), 4: (torch.float32,)}
_LENGTH = struct.Struct("<Q")


class ChunkCodec(Protocol):
    """What a worker runs of a codec (see the module docstring)."""

    @property
    def name(self) -> str: ...

    @property
    def raw_bytes(self) -> int: ...

    @property
    def stored_bytes(self) -> int: ...

    def encode(self, raw: torch.Tensor, out: torch.Tensor) -> None: ...

    def decode(self, stored: torch.Tensor, out: torch.Tensor) -> None: ...

    def used_bytes(self, stored: memoryview) -> int: ...


def fp8_run(elements: int, most: int = FP8_RUN) -> int:
    """The elements per scale for a chunk of ``elements`` values: the largest power of
    two up to ``most`` (:data:`FP8_RUN`) that divides it (a page's size is a power of
    two times the head size in vLLM's layouts)."""
    run = most
    while run > 1 and elements % run:
        run //= 2
    return run


def stored_bytes(codec: str, raw_bytes: int, dtype_bytes: int) -> int:
    """The bytes a chunk of ``raw_bytes`` takes in a tier under ``codec``."""
    if codec == "none":
        return raw_bytes
    if codec == "fp8":
        if dtype_bytes not in KV_DTYPES:
            raise ConfigError("codec", f"fp8 encodes 16- and 32-bit KV, not {8 * dtype_bytes}-bit")
        elements = raw_bytes // dtype_bytes
        return fp8.encoded_bytes(elements, fp8_run(elements))
    if codec == "lossless":
        return raw_bytes + LOSSLESS_OVERHEAD
    raise ConfigError("codec", f"unknown codec {codec!r}")


@dataclass(frozen=True)
class Fp8Chunks:
    """fp8 over one rank's chunks of ``dtype`` values (see :mod:`.fp8`)."""

    dtype: torch.dtype
    raw_bytes: int
    name: str = "fp8"

    @property
    def elements(self) -> int:
        return self.raw_bytes // self.dtype.itemsize

    @property
    def run(self) -> int:
        return fp8_run(self.elements)

    @property
    def stored_bytes(self) -> int:
        return fp8.encoded_bytes(self.elements, self.run)

    def encode(self, raw: torch.Tensor, out: torch.Tensor) -> None:
        """``raw`` (uint8, ``raw_bytes``) encoded into ``out`` (uint8, ``stored_bytes``);
        ``ValueError`` for a value that is not finite (``out`` then undefined)."""
        out.copy_(fp8.encode(raw.view(self.dtype), self.run))

    def decode(self, stored: torch.Tensor, out: torch.Tensor) -> None:
        """``stored`` decoded into ``out`` (uint8, ``raw_bytes``)."""
        fp8.decode(stored, self.dtype, self.run, out=out.view(self.dtype))

    def used_bytes(self, stored: memoryview) -> int:
        return self.stored_bytes


@dataclass(frozen=True)
class LosslessChunks:
    """lossless (:mod:`.lossless`) over one rank's chunks of values of ``typesize``
    bytes, framed as the module docstring says. Bit-exact."""

    typesize: int
    raw_bytes: int
    name: str = "lossless"

    @property
    def stored_bytes(self) -> int:
        return self.raw_bytes + LOSSLESS_OVERHEAD

    def encode(self, raw: torch.Tensor, out: torch.Tensor) -> None:
        frame = lossless.encode(raw.numpy().data, self.typesize)
        if _LENGTH.size + len(frame) > self.stored_bytes:  # blosc2 bounds its frames
            raise ValueError(f"lossless: a frame of {len(frame)} B exceeds its slot")
        view = out.numpy()
        view[: _LENGTH.size] = memoryview(_LENGTH.pack(len(frame)))
        view[_LENGTH.size : _LENGTH.size + len(frame)] = memoryview(frame)

    def frame(self, stored: memoryview) -> memoryview:
        """The frame a slot holds; ``CorruptChunk`` for a length that does not fit."""
        (length,) = _LENGTH.unpack_from(stored)
        if not 0 < length <= len(stored) - _LENGTH.size:
            raise lossless.CorruptChunk(f"lossless: frame length {length} in a slot")
        return stored[_LENGTH.size : _LENGTH.size + length]

    def decode(self, stored: torch.Tensor, out: torch.Tensor) -> None:
        data = lossless.decode(self.frame(stored.numpy().data), self.raw_bytes)
        out.numpy()[:] = memoryview(data)

    def used_bytes(self, stored: memoryview) -> int:
        return _LENGTH.size + len(self.frame(stored))


def open_kv_codec(
    codec: str, dtypes: Collection[torch.dtype], raw_bytes: int, option: str = "codec"
) -> ChunkCodec | None:
    """:func:`open_codec` for KV tensors of ``dtypes``: ConfigError naming ``option``
    unless they share one dtype (a codec reads a chunk as values of one dtype)."""
    if codec == "none":
        return None
    kinds = set(dtypes)
    if len(kinds) != 1:
        raise ConfigError(option, f"{codec} needs KV of one dtype, not {sorted(map(str, kinds))}")
    return open_codec(codec, kinds.pop(), raw_bytes)


def open_codec(codec: str, dtype: torch.dtype, raw_bytes: int) -> ChunkCodec | None:
    """The codec a worker runs for KV of ``dtype`` (None: ``none``); ConfigError for a
    codec this KV cannot take, or (lossless) whose library is not installed."""
    if codec == "none":
        return None
    if codec == "fp8":
        if dtype not in KV_DTYPES.get(dtype.itemsize, ()):
            raise ConfigError("codec", f"fp8 encodes 16- and 32-bit float KV, not {dtype}")
        return Fp8Chunks(dtype, raw_bytes)
    if codec == "lossless":
        if not lossless.available():
            raise ConfigError(
                "codec", "lossless needs blosc2: pip install 'kvoffload[codecs]' (or blosc2)"
            )
        return LosslessChunks(dtype.itemsize, raw_bytes)
    raise ConfigError("codec", f"unknown codec {codec!r}")
