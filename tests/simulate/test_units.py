"""Byte sizes with human units."""

from __future__ import annotations

import pytest

from kvoffload.core.errors import UsageError
from kvoffload.simulate.units import format_bytes, parse_byte_list, parse_bytes


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
    assert parse_byte_list("4GiB, 1GiB,4GiB", "--sweep") == [2**30, 4 * 2**30]
    with pytest.raises(UsageError, match="must be > 0"):
        parse_byte_list("0,1GiB", "--sweep")
    with pytest.raises(UsageError, match="comma-separated"):
        parse_byte_list(" , ", "--sweep")


def test_format() -> None:
    assert [format_bytes(n) for n in (0, 1023, 1024, 1536, 64 * 2**30, 2**41)] == [
        "0B",
        "1023B",
        "1KiB",
        "1.5KiB",
        "64GiB",
        "2TiB",
    ]
