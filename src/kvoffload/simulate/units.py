"""Byte sizes with human units: ``8GiB``, ``512MiB``, ``1.5GB``, ``4096``; tier
sizes also in chunks (``9139chunks``) or as a share of the workload's distinct
chunks (``5%``).

Binary units (KiB, MiB, GiB, TiB) are powers of 1024, decimal ones (KB, MB, GB, TB)
powers of 1000; a bare number is bytes. ``N%`` is ``floor(N / 100 x distinct
chunks)`` chunks. Parsing is for user input and raises
:class:`~kvoffload.core.errors.UsageError` naming the option.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from kvoffload.core.errors import UsageError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str, option: str) -> int:
    """``text`` as a whole number of bytes >= 0; UsageError naming ``option`` if not."""
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise UsageError(f"{option}: {text!r} is not a size (examples: 8GiB, 512MiB, 1.5GB, 4096)")
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value):
        raise UsageError(f"{option}: {text!r} is too large")
    return int(value)


_CHUNKS = re.compile(r"^\s*([0-9]+)\s*(?:chunks?|ch)\s*$", re.IGNORECASE)
_SHARE = re.compile(r"^\s*([0-9.]+)\s*%\s*$")


@dataclass(frozen=True)
class ChunkUnits:
    """What ``N chunks`` and ``N%`` mean: bytes per chunk and the workload's distinct
    chunks (None: unknown, so a share is refused)."""

    chunk_bytes: int
    distinct_chunks: int | None = None


def is_share(text: str) -> bool:
    """Whether ``text`` (one size or a comma-separated list) has a ``%`` size."""
    return "%" in text


def parse_size(text: str, option: str, units: ChunkUnits) -> int:
    """``text`` as bytes: a byte size, ``N chunks`` or ``N%`` of the distinct chunks
    (whole chunks, rounded down); UsageError naming ``option`` if not."""
    chunks = _CHUNKS.match(text)
    if chunks is not None:
        return int(chunks.group(1)) * units.chunk_bytes
    share = _SHARE.match(text)
    if share is None:
        if _SIZE.match(text) is None:
            raise UsageError(
                f"{option}: {text!r} is not a size (examples: 8GiB, 1.5GB, 9139chunks, 5%)"
            )
        return parse_bytes(text, option)
    try:
        percent = Decimal(share.group(1))
    except InvalidOperation:
        raise UsageError(f"{option}: {text!r} is not a share (examples: 5%, 12.5%)") from None
    if units.distinct_chunks is None:
        raise UsageError(f"{option}: a share needs the workload's distinct chunks")
    count = int(percent * units.distinct_chunks / 100)
    return count * units.chunk_bytes


def parse_size_list(text: str, option: str, units: ChunkUnits) -> list[int]:
    """A comma-separated list of :func:`parse_size` sizes, each > 0, sorted and
    without duplicates."""
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise UsageError(f"{option}: give comma-separated sizes, e.g. 8GiB,16GiB or 5%,10%")
    values = sorted({parse_size(p, option, units) for p in parts})
    if values[0] <= 0:
        raise UsageError(f"{option}: sizes must be > 0")
    return values


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps the number >= 1."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{n:.0f}B"
