"""A chunk codec as the transfer worker uses it: one rank's chunk of ``raw_bytes``
(its block records, as :mod:`kvoffload.transfer.layout` lays them out) kept in a tier
slot of ``stored_bytes`` (issue 33).

:func:`stored_bytes` is the pure size rule (the geometry sizes each tier with it);
:func:`open_codec` builds the codec a worker runs (``none``: no codec object, a slot
holds the records). Every codec has the same contract (:class:`ChunkCodec`):
``encode`` writes the first :meth:`~ChunkCodec.used_bytes` of the stored slot
(fp8: all of it) and raises ``ValueError`` for a chunk it cannot encode (nothing
then counts as written); ``decode`` fills the whole raw chunk and raises
``ValueError`` (:class:`~kvoffload.codecs.frame_check.CorruptChunk`) for bytes it
did not write, checked against the frame's checksum (issue 41,
:mod:`~kvoffload.codecs.frame_check`) before anything is decoded, so ``out`` is
untouched then.

Frames (little-endian; the checksum is xxh3-64 of the bytes after it):

- ``lossless``: a slot of ``raw_bytes`` + :data:`LOSSLESS_OVERHEAD` holds the 8-byte
  frame length, the 8-byte checksum of the frame, then the blosc2 frame (blosc2
  stores a chunk it cannot shrink as it is, with at most 32 bytes of its own
  header), then unused bytes. A tier keyed by chunk (Redis) stores only the used
  bytes;
- ``fp8``: the 8-byte checksum, then the scales and the e4m3 values
  (:mod:`~kvoffload.codecs.fp8`): :data:`FRAME_CHECK_BYTES` more than
  :func:`~kvoffload.codecs.fp8.encoded_bytes`. :meth:`Fp8Chunks.payload`,
  :meth:`~Fp8Chunks.seal` and :meth:`~Fp8Chunks.check` let the GPU path
  (``transfer/cuda_codec_copy.py``) encode and decode the payload on the device and
  keep the checksum on the host.
"""

from __future__ import annotations

import struct
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

import torch

from kvoffload.codecs import FP8_RUN, FRAME_CHECK_BYTES, LOSSLESS_OVERHEAD, fp8, lossless
from kvoffload.codecs.frame_check import CorruptChunk, Digest, check, seal, xxh3
from kvoffload.core.errors import ConfigError

KV_DTYPES = {2: (torch.bfloat16, torch.float16), 4: (torch.float32,)}
_LENGTH = struct.Struct("<Q")
_HEADER = _LENGTH.size + FRAME_CHECK_BYTES
"""A lossless slot's header: the frame length, then the frame's checksum."""


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
        return FRAME_CHECK_BYTES + fp8.encoded_bytes(elements, fp8_run(elements))
    if codec == "lossless":
        return raw_bytes + LOSSLESS_OVERHEAD
    raise ConfigError("codec", f"unknown codec {codec!r}")


@dataclass(frozen=True)
class Fp8Chunks:
    """fp8 over one rank's chunks of ``dtype`` values (see :mod:`.fp8`), framed as
    the module docstring says. ``digest``: the checksum, xxh3-64 (the frames' format;
    ``scripts/gpu-check`` gives another where xxhash is not installed, and
    ``bench/codec_frame_check.py`` none, to time the codec without it)."""

    dtype: torch.dtype
    raw_bytes: int
    name: str = "fp8"
    digest: Digest = xxh3

    @property
    def elements(self) -> int:
        return self.raw_bytes // self.dtype.itemsize

    @property
    def run(self) -> int:
        return fp8_run(self.elements)

    @property
    def stored_bytes(self) -> int:
        return FRAME_CHECK_BYTES + fp8.encoded_bytes(self.elements, self.run)

    @staticmethod
    def payload(stored: torch.Tensor) -> torch.Tensor:
        """The scales and values of a stored chunk (a view: ``stored`` past its
        checksum)."""
        return stored[FRAME_CHECK_BYTES:]

    def seal(self, stored: torch.Tensor) -> None:
        """Write the checksum of ``stored``'s payload (a host tensor) into its header."""
        view = stored.numpy().data
        seal(view, 0, view[FRAME_CHECK_BYTES:], self.digest)

    def check(self, stored: torch.Tensor) -> None:
        """``CorruptChunk`` unless ``stored`` (a host tensor of ``stored_bytes``)
        holds the checksum of its payload."""
        if stored.numel() != self.stored_bytes:
            raise CorruptChunk(f"fp8: {stored.numel()} B, not a chunk of {self.stored_bytes} B")
        view = stored.numpy().data
        check(view, 0, view[FRAME_CHECK_BYTES:], self.name, self.digest)

    def encode(self, raw: torch.Tensor, out: torch.Tensor) -> None:
        """``raw`` (uint8, ``raw_bytes``) encoded into ``out`` (uint8, ``stored_bytes``);
        ``ValueError`` for a value that is not finite (``out`` then undefined)."""
        self.payload(out).copy_(fp8.encode(raw.view(self.dtype), self.run))
        self.seal(out)

    def decode(self, stored: torch.Tensor, out: torch.Tensor) -> None:
        """``stored`` decoded into ``out`` (uint8, ``raw_bytes``); ``CorruptChunk``
        (``out`` untouched) when its checksum does not match."""
        self.check(stored)
        fp8.decode(self.payload(stored), self.dtype, self.run, out=out.view(self.dtype))

    def used_bytes(self, stored: memoryview) -> int:
        return self.stored_bytes


@dataclass(frozen=True)
class LosslessChunks:
    """lossless (:mod:`.lossless`) over one rank's chunks of values of ``typesize``
    bytes, framed as the module docstring says. Bit-exact. ``digest``: the frame's
    checksum (xxh3-64, the frames' format; ``bench/codec_frame_check.py`` replaces it
    to time the codec without it)."""

    typesize: int
    raw_bytes: int
    name: str = "lossless"
    digest: Digest = xxh3

    @property
    def stored_bytes(self) -> int:
        return self.raw_bytes + LOSSLESS_OVERHEAD

    def encode(self, raw: torch.Tensor, out: torch.Tensor) -> None:
        frame = lossless.encode(raw.numpy().data, self.typesize)
        if _HEADER + len(frame) > self.stored_bytes:  # blosc2 bounds its frames
            raise ValueError(f"lossless: a frame of {len(frame)} B exceeds its slot")
        view = out.numpy().data
        _LENGTH.pack_into(view, 0, len(frame))
        view[_HEADER : _HEADER + len(frame)] = frame
        seal(view, _LENGTH.size, view[_HEADER : _HEADER + len(frame)], self.digest)

    def frame(self, stored: memoryview) -> memoryview:
        """The frame a slot holds; ``CorruptChunk`` for a length that does not fit.
        Its checksum is not checked here (:meth:`decode` does)."""
        (length,) = _LENGTH.unpack_from(stored)
        if not 0 < length <= len(stored) - _HEADER:
            raise CorruptChunk(f"lossless: frame length {length} in a slot")
        return stored[_HEADER : _HEADER + length]

    def decode(self, stored: torch.Tensor, out: torch.Tensor) -> None:
        """``stored`` decoded into ``out``; ``CorruptChunk`` (``out`` untouched) for a
        frame whose checksum does not match, or that does not decode."""
        view = stored.numpy().data
        frame = self.frame(view)
        check(view, _LENGTH.size, frame, self.name, self.digest)
        data = lossless.decode(frame, self.raw_bytes)
        out.numpy()[:] = memoryview(data)

    def used_bytes(self, stored: memoryview) -> int:
        return _HEADER + len(self.frame(stored))


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
