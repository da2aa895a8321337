"""Sealing and opening one chunk: what opens, and everything that must not
(decision 0024)."""

from __future__ import annotations

import os

import pytest

from kvoffload.sealing.keyfile import SealKeys, derive
from kvoffload.sealing.layout import PREFIX_BYTES, SEAL_BYTES, SealContext
from kvoffload.sealing.sealer import Sealer, SealError

CONTEXT = SealContext(namespace=b"n" * 16, storage_key=b"k" * 16, group=0, groups=2)


def keys(*materials: bytes) -> SealKeys:
    return SealKeys(tuple(derive(m) for m in materials))


A, B = os.urandom(32), os.urandom(32)


def sealed(plain: bytes, sealer: Sealer, context: SealContext = CONTEXT) -> bytearray:
    out = bytearray(len(plain) + SEAL_BYTES)
    assert sealer.seal_into(memoryview(plain), memoryview(out), context) == len(out)
    return out


def open_(
    data: bytes | bytearray, sealer: Sealer, size: int, context: SealContext = CONTEXT
) -> bytes:
    out = bytearray(size)
    n = sealer.open_into(memoryview(bytes(data)), memoryview(out), context)
    return bytes(out[:n])


def test_a_sealed_chunk_opens_to_its_bytes() -> None:
    sealer = Sealer(keys(A))
    plain = os.urandom(4096)
    assert open_(sealed(plain, sealer), sealer, 4096) == plain


def test_no_run_of_the_plaintext_is_in_the_sealed_bytes_and_nonces_are_fresh() -> None:
    sealer = Sealer(keys(A))
    plain = bytes(range(256)) * 16  # repetitive, as KV rows can be
    one, two = sealed(plain, sealer), sealed(plain, sealer)
    assert one != two  # a fresh nonce each write
    for start in range(0, len(plain) - 16, 97):
        assert plain[start : start + 16] not in one


def test_every_single_bit_flip_fails_to_open() -> None:
    sealer = Sealer(keys(A))
    plain = os.urandom(512)
    good = sealed(plain, sealer)
    for bit in range(0, len(good) * 8, 7):
        bad = bytearray(good)
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(SealError):
            open_(bad, sealer, 512)


@pytest.mark.parametrize(
    "other",
    [
        SealContext(b"n" * 16, b"K" * 16, 0, 2),  # another chunk (swapped values)
        SealContext(b"N" * 16, b"k" * 16, 0, 2),  # another namespace
        SealContext(b"n" * 16, b"k" * 16, 1, 2),  # another group
        SealContext(b"n" * 16, b"k" * 16, 0, 2, chunk_format=2),  # another format
    ],
)
def test_a_chunk_sealed_for_another_context_does_not_open(other: SealContext) -> None:
    sealer = Sealer(keys(A))
    with pytest.raises(SealError, match="does not open"):
        open_(sealed(b"x" * 64, sealer), sealer, 64, other)


def test_truncated_extended_and_unsealed_values_do_not_open() -> None:
    sealer = Sealer(keys(A))
    good = sealed(b"y" * 256, sealer)
    with pytest.raises(SealError):
        open_(good[:-1], sealer, 256)
    with pytest.raises(SealError):
        open_(good[:PREFIX_BYTES], sealer, 256)
    with pytest.raises(SealError, match="not a sealed chunk"):
        open_(b"\0" * len(good), sealer, 256)
    with pytest.raises(SealError, match="does not fit"):
        open_(good, sealer, 255)  # longer than the caller's buffer


def test_rotation_old_keys_open_the_first_seals_unknown_keys_refused() -> None:
    old = Sealer(keys(A))
    rotated = Sealer(keys(B, A))
    plain = os.urandom(300)
    assert open_(sealed(plain, old), rotated, 300) == plain
    fresh = sealed(plain, rotated)
    assert int.from_bytes(fresh[8:12], "little") == derive(B).key_id
    with pytest.raises(SealError, match="not in the key file"):
        open_(fresh, old, 300)


def test_a_forged_prefix_with_a_known_key_id_does_not_open() -> None:
    sealer = Sealer(keys(A))
    good = sealed(b"z" * 128, sealer)
    forged = bytearray(good)
    forged[PREFIX_BYTES:-16] = bytes(len(forged) - PREFIX_BYTES - 16)
    with pytest.raises(SealError):
        open_(forged, sealer, 128)
