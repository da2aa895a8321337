"""The stored-chunk header: every field is checked, every mismatch is named."""

from __future__ import annotations

import os

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
