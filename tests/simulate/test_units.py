"""Byte sizes with human units."""

from __future__ import annotations

import re

import pytest

from kvoffload.core.errors import UsageError
from kvoffload.simulate.units import (
    ChunkUnits,
    format_bytes,
    parse_bytes,
    parse_size,
    parse_size_list,
)


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("4096", 4096),
        ("0", 0),
        ("8GiB", 8 * 2**30),
        ("8 gib", 8 * 2**30),
        ("1.5GB", 1_500_000_000),
        ("512MiB", 512 * 2**20),
        ("2TiB", 2 * 2**40),
        ("10k", 10_000),
        (".5KiB", 512),
    ],
)
def test_sizes(text: str, value: int) -> None:
    assert parse_bytes(text, "--x") == value


@pytest.mark.parametrize("text", ["", "GiB", "-1GiB", "8 parsecs", "1e9", "0x10"])
def test_bad_sizes_name_the_option(text: str) -> None:
    with pytest.raises(UsageError, match="^--cpu-bytes: "):
        parse_bytes(text, "--cpu-bytes")


def test_lists_are_sorted_without_duplicates() -> None:
    units = ChunkUnits(chunk_bytes=1000)
    assert parse_size_list("4GiB, 1GiB,4GiB", "--sweep", units) == [2**30, 4 * 2**30]
    with pytest.raises(UsageError, match="must be > 0"):
        parse_size_list("0,1GiB", "--sweep", units)
    with pytest.raises(UsageError, match="comma-separated"):
        parse_size_list(" , ", "--sweep", units)


def test_format() -> None:
    assert [format_bytes(n) for n in (0, 1023, 1024, 1536, 64 * 2**30, 2**41)] == [
        "0B",
        "1023B",
        "1KiB",
        "1.5KiB",
        "64GiB",
        "2TiB",
    ]


UNITS = ChunkUnits(chunk_bytes=1000, distinct_chunks=182_790)


@pytest.mark.parametrize(
    ("text", "chunks"),
    [
        ("5%", 9139),  # 9139.5 rounds down to whole chunks
        ("10%", 18279),
        ("25%", 45697),
        ("50 %", 91395),
        ("12.5%", 22848),
        ("100%", 182_790),
        ("9139chunks", 9139),
        ("1 chunk", 1),
        ("64ch", 64),
    ],
)
def test_sizes_in_chunks_and_shares(text: str, chunks: int) -> None:
    assert parse_size(text, "--cpu-bytes", UNITS) == chunks * 1000


def test_a_size_without_chunks_is_bytes() -> None:
    assert parse_size("8GiB", "--cpu-bytes", UNITS) == 8 * 2**30
    assert parse_size_list("5%,1chunk,5%", "--sweep", UNITS) == [1000, 9139 * 1000]


@pytest.mark.parametrize(
    ("text", "units", "message"),
    [
        ("5%", ChunkUnits(1000), "a share needs the workload's distinct chunks"),
        ("1.2.3%", UNITS, "is not a share"),
        ("lots", UNITS, "'lots' is not a size (examples: 8GiB, 1.5GB, 9139chunks, 5%)"),
    ],
)
def test_bad_sizes(text: str, units: ChunkUnits, message: str) -> None:
    with pytest.raises(UsageError, match=re.escape(message)):
        parse_size(text, "--cpu-bytes", units)
