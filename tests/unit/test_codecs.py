"""The chunk codecs on their own (``kvoffload.codecs``): fp8 within e4m3's bound for
16- and 32-bit KV, its size, zeros and refusals; lossless bit-exact for every KV
dtype, and bytes it did not write refused."""

from __future__ import annotations

import pytest
import torch

from kvoffload.codecs import FP8_RUN, fp8, fp8_ratio, lossless

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def kv(dtype: torch.dtype, n: int = 4 * FP8_RUN, seed: int = 0) -> torch.Tensor:
    """Values over five decades of magnitude, signs mixed (KV-like and harder)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * torch.logspace(-3, 2, n)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_is_within_e4m3s_bound_and_its_size(dtype: torch.dtype) -> None:
    x = kv(dtype)
    encoded = fp8.encode(x, FP8_RUN)
    assert encoded.dtype == torch.uint8
    assert encoded.numel() == fp8.encoded_bytes(x.numel(), FP8_RUN) == x.numel() + 4 * 4
    assert x.numel() * x.element_size() / encoded.numel() == pytest.approx(
        fp8_ratio(x.element_size())
    )
    decoded = fp8.decode(encoded, dtype, FP8_RUN)
    assert decoded.dtype == dtype and fp8.within_bound(x, decoded, FP8_RUN)
    # The bound is not vacuous: a value off by 10% of the largest is outside it.
    bad = decoded.clone()
    bad[7] += 0.1 * x.float().abs().max().to(dtype)
    assert not fp8.within_bound(x, bad, FP8_RUN)
    # The largest magnitude of each run is kept within e4m3's relative rounding.
    top = x.float().abs().view(-1, FP8_RUN).argmax(dim=1)
    rows = torch.arange(4)
    want, got = x.float().view(-1, FP8_RUN), decoded.float().view(-1, FP8_RUN)
    assert torch.allclose(got[rows, top], want[rows, top], rtol=2**-4)


def test_fp8_zero_runs_decode_to_zeros_and_bad_input_is_refused() -> None:
    x = torch.zeros(2 * FP8_RUN, dtype=torch.bfloat16)
    x[FP8_RUN:] = 1.5
    decoded = fp8.decode(fp8.encode(x, FP8_RUN), torch.bfloat16, FP8_RUN)
    assert torch.equal(decoded, x)  # 0 and 1.5 are exact in e4m3 after scaling
    nan = x.clone()
    nan[3] = float("nan")
    with pytest.raises(ValueError, match="not finite"):
        fp8.encode(nan, FP8_RUN)
    with pytest.raises(ValueError, match="runs of"):
        fp8.encode(x[:100], FP8_RUN)
    with pytest.raises(ValueError, match="16/32-bit"):
        fp8.encode(x.to(torch.float8_e4m3fn), FP8_RUN)
    with pytest.raises(ValueError, match="runs of"):
        fp8.decode(torch.zeros(7, dtype=torch.uint8), torch.bfloat16, FP8_RUN)
    with pytest.raises(ValueError, match="8-bit"):
        fp8_ratio(1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_lossless_is_bit_exact_and_smaller(dtype: torch.dtype) -> None:
    raw = kv(dtype).view(torch.uint8).numpy().tobytes()
    width = torch.empty((), dtype=dtype).element_size()
    encoded = lossless.encode(raw, width)
    assert lossless.decode(encoded, len(raw)) == raw
    assert len(encoded) < len(raw)  # the exponent plane shrinks, whatever the mantissas


def test_lossless_refuses_bytes_it_did_not_write() -> None:
    raw = kv(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    encoded = lossless.encode(raw, 2)
    with pytest.raises(lossless.CorruptChunk):
        lossless.decode(b"\x00" * 64, len(raw))
    with pytest.raises(lossless.CorruptChunk):
        lossless.decode(encoded, len(raw) + 2)
    with pytest.raises(lossless.CorruptChunk):
        lossless.decode(encoded[: len(encoded) // 2], len(raw))
