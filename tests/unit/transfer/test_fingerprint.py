"""Content checksums of tensors on their own device, and fingerprints of named
tensors (decision 0019): equal bytes give equal fingerprints, any change of bytes,
dtype, shape, name or order of words gives another."""

from __future__ import annotations

import torch

from kvoffload.transfer import fingerprint as fp
from kvoffload.transfer.fingerprint import checksum, fingerprint


def named(*tensors: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return [(f"t{i}", t) for i, t in enumerate(tensors)]


def test_equal_bytes_give_equal_fingerprints_and_a_copy_is_equal() -> None:
    a = torch.randn(33, 17)
    assert fingerprint(named(a)) == fingerprint(named(a.clone()))
    assert fingerprint(named(a.t().contiguous().t())) == fingerprint(named(a))  # strides


def test_one_changed_element_changes_the_fingerprint() -> None:
    a = torch.randn(1000, 3)
    b = a.clone()
    b[500, 1] *= 2.0
    assert fingerprint(named(a)) != fingerprint(named(b))


def test_moved_words_change_the_fingerprint_though_the_sum_is_the_same() -> None:
    a = torch.arange(64, dtype=torch.float64)
    b = a.flip(0)
    assert checksum(a)[0] == checksum(b)[0]  # the plain sum cannot tell
    assert fingerprint(named(a)) != fingerprint(named(b))


def test_name_dtype_shape_and_extra_are_part_of_it() -> None:
    a = torch.zeros(4, 4)
    base = fingerprint(named(a))
    assert fingerprint([("other", a)]) != base
    assert fingerprint(named(a.view(16))) != base
    assert fingerprint(named(a.to(torch.float16))) != base
    assert fingerprint(named(a), b"x") != base


def test_sizes_not_multiple_of_eight_bytes_and_small_pieces(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(fp, "PIECE_WORDS", 3)  # many pieces
    a = torch.arange(13, dtype=torch.uint8)
    b = a.clone()
    b[12] = 99  # a byte past the last whole word
    assert fingerprint(named(a)) != fingerprint(named(b))
    c = torch.randn(101)
    monkeypatch.setattr(fp, "PIECE_WORDS", 1 << 22)
    whole = fingerprint(named(c))
    monkeypatch.setattr(fp, "PIECE_WORDS", 7)
    assert fingerprint(named(c)) == whole  # the pieces do not change the sums


def test_empty_and_meta_tensors_sum_to_zero() -> None:
    assert checksum(torch.empty(0)).tolist() == [0, 0]
    assert checksum(torch.empty(3, device="meta")).tolist() == [0, 0]
