"""A chunk codec as the transfer worker uses it: one rank's chunk of ``raw_bytes``
(its block records, as :mod:`kvoffload.transfer.layout` lays them out) kept in a host
slot of ``stored_bytes``, and what every lower tier stores of it (issue 33).

:func:`stored_bytes` is the pure size rule (the geometry sizes every tier with it);
:func:`open_codec` builds the codec a worker runs. Only ``fp8`` changes the bytes
today (``none``: no codec object, the slot holds the records). Encoding writes the
whole stored slot; decoding fills the whole raw chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvoffload.codecs import FP8_RUN, fp8
from kvoffload.core.errors import ConfigError

KV_DTYPES = {2: (torch.bfloat16, torch.float16), 4: (torch.float32,)}


def fp8_run(elements: int) -> int:
    """The elements per scale for a chunk of ``elements`` values: the largest power of
    two up to :data:`FP8_RUN` that divides it (a page's size is a power of two times
    the head size in vLLM's layouts)."""
    run = FP8_RUN
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


def open_codec(codec: str, dtype: torch.dtype, raw_bytes: int) -> Fp8Chunks | None:
    """The codec a worker runs for KV of ``dtype`` (None: ``none``); ConfigError for a
    codec this KV cannot take."""
    if codec == "none":
        return None
    if codec == "fp8":
        if dtype not in KV_DTYPES.get(dtype.itemsize, ()):
            raise ConfigError("codec", f"fp8 encodes 16- and 32-bit float KV, not {dtype}")
        return Fp8Chunks(dtype, raw_bytes)
    raise ConfigError("codec", f"unknown codec {codec!r}")
