"""The stored-chunk header: every field is checked, every mismatch is named; the KV
cache group round-trips, and headers written before it existed still verify."""

from __future__ import annotations

import os
import struct

import pytest

from kvoffload.core import chunk_format as cf
from kvoffload.core.chunk_format import IntegrityError, IntegrityReason

DIGEST, KEY = b"d" * 16, b"k" * 16
PAYLOAD = os.urandom(4096)


def stored(payload: bytes = PAYLOAD) -> bytearray:
    return bytearray(cf.encode_header(DIGEST, KEY, payload) + payload)


def test_header_is_64_bytes_and_round_trips() -> None:
    assert len(cf.encode_header(DIGEST, KEY, PAYLOAD)) == cf.HEADER_BYTES == 64
    assert bytes(cf.verify(stored(), DIGEST, KEY, len(PAYLOAD))) == PAYLOAD


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda b: b[:40], IntegrityReason.SIZE),
        (lambda b: b[:-1], IntegrityReason.SIZE),
        (lambda b: b"XXXX" + b[4:], IntegrityReason.MAGIC),
        (lambda b: b[:4] + b"\x02\x00" + b[6:], IntegrityReason.VERSION),
        (lambda b: b[:16] + b"e" * 16 + b[32:], IntegrityReason.FORMAT),
        (lambda b: b[:32] + b"j" * 16 + b[48:], IntegrityReason.KEY),
        (lambda b: b[:56] + b"\x01\x00" + b[58:], IntegrityReason.GROUP),  # 1 of 1 group
        (lambda b: b[:100] + bytes([b[100] ^ 1]) + b[101:], IntegrityReason.CHECKSUM),
        (lambda b: b + b"extra", IntegrityReason.SIZE),
    ],
)
def test_every_corruption_is_rejected_with_its_reason(mutate, reason) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(IntegrityError) as info:
        cf.verify(bytes(mutate(bytes(stored()))), DIGEST, KEY, len(PAYLOAD))
    assert info.value.reason is reason


def test_a_payload_of_another_length_is_rejected() -> None:
    with pytest.raises(IntegrityError) as info:
        cf.verify(stored(PAYLOAD[:100]), DIGEST, KEY, len(PAYLOAD))
    assert info.value.reason is IntegrityReason.LENGTH


def test_garbage_of_any_size_never_verifies() -> None:
    for size in (0, 10, 64, 65, 5000):
        with pytest.raises(IntegrityError):
            cf.verify(os.urandom(size), DIGEST, KEY, len(PAYLOAD))


OLD_HEADER = struct.Struct("<4sHHQ16s16sQ8x")  # version 1 before the group fields


def test_a_header_names_its_group_and_the_reader_checks_it() -> None:
    header = cf.encode_header(DIGEST, KEY, PAYLOAD, group=3, groups=6)
    assert cf.header_group(header) == (3, 6)
    assert header[56:64] == bytes([3, 0, 5, 0, 0, 0, 0, 0])  # little-endian, groups - 1
    value = header + PAYLOAD
    assert bytes(cf.verify(value, DIGEST, KEY, len(PAYLOAD), group=3)) == PAYLOAD
    assert bytes(cf.verify(value, DIGEST, KEY, len(PAYLOAD), group=None)) == PAYLOAD
    for wanted in (0, 2, 5):
        with pytest.raises(IntegrityError) as info:
            cf.verify(value, DIGEST, KEY, len(PAYLOAD), group=wanted)
        assert info.value.reason is IntegrityReason.GROUP
        assert f"group 3 of 6, expected group {wanted}" in str(info.value)


def test_a_header_written_before_the_group_fields_verifies_as_group_0() -> None:
    old = OLD_HEADER.pack(cf.MAGIC, 1, 0, len(PAYLOAD), DIGEST, KEY, cf.checksum(PAYLOAD))
    assert len(old) == cf.HEADER_BYTES and old[56:] == bytes(8)
    assert cf.header_group(old) == (0, 1)
    assert bytes(cf.verify(old + PAYLOAD, DIGEST, KEY, len(PAYLOAD))) == PAYLOAD
    assert bytes(cf.verify(old + PAYLOAD, DIGEST, KEY, len(PAYLOAD), group=None)) == PAYLOAD
    with pytest.raises(IntegrityError) as info:
        cf.verify(old + PAYLOAD, DIGEST, KEY, len(PAYLOAD), group=1)
    assert info.value.reason is IntegrityReason.GROUP
    # a one-group chunk written today is byte for byte what was always written
    assert cf.encode_header(DIGEST, KEY, PAYLOAD) == old
    assert cf.encode_header(DIGEST, KEY, PAYLOAD, group=0, groups=1) == old


def test_a_group_outside_its_own_layout_never_verifies() -> None:
    bad = bytearray(cf.encode_header(DIGEST, KEY, PAYLOAD, group=1, groups=2))
    bad[56] = 2  # group 2 of 2 groups
    with pytest.raises(IntegrityError) as info:
        cf.verify(bytes(bad) + PAYLOAD, DIGEST, KEY, len(PAYLOAD), group=None)
    assert info.value.reason is IntegrityReason.GROUP


@pytest.mark.parametrize(("group", "groups"), [(1, 1), (-1, 2), (0, 0), (0, cf.MAX_GROUPS + 1)])
def test_a_header_cannot_name_an_impossible_group(group: int, groups: int) -> None:
    with pytest.raises(ValueError):
        cf.encode_header(DIGEST, KEY, PAYLOAD, group=group, groups=groups)
