"""The ``fp8`` chunk codec: KV elements as float8 e4m3 with one float32 scale per run
(issue 33). Lossy, opt-in.

A chunk's payload (the host slab's bytes of one chunk: block records of pages, each
page a contiguous run of the KV dtype, ``transfer/layout.py``) is viewed as
``elements`` values of its dtype (bfloat16, float16 or float32) in runs of
``run`` consecutive elements (one run per layer, block and KV head in vLLM's
layouts: the caller picks ``run``; it must divide the element count). Encoded::

    runs x float32 scale | elements x float8_e4m3fn

each run scaled by ``absmax / 448`` (e4m3's largest finite value) so that its
largest magnitude maps to 448; an all-zero run has scale 0 and decodes to zeros.

Error bound (checked by :func:`within_bound`): e4m3 keeps 3 mantissa bits, so a
value in e4m3's normal range is rounded within 2**-4 of itself relatively; values
below its smallest normal (2**-6 after scaling) are rounded within half its smallest
subnormal step, 2**-10 after scaling. So ``|decoded - x| <= 2**-4 * |x| + 2**-10 *
scale`` per element, plus the rounding of the decoded value back to a 16-bit dtype
(``2**-8 |x|`` for bfloat16, ``2**-11 |x|`` for float16). Non-finite values are not
encoded: :func:`encode` raises ``ValueError`` (the caller stores nothing then: a
miss later, never a wrong value).

Size: ``elements + 4 * runs`` bytes against ``elements * itemsize``: with runs of
4,096 elements, 1.998x smaller than 16-bit KV and 3.996x smaller than 32-bit KV. A
tier slot holds this behind an 8-byte checksum (``chunk_codec.py``, issue 41).
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_OUTPUT_ROUNDING = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 0.0}


def encoded_bytes(elements: int, run: int) -> int:
    """The encoded size of ``elements`` values in runs of ``run``."""
    return elements + 4 * (elements // run)


def encode(raw: torch.Tensor, run: int) -> torch.Tensor:
    """``raw`` (a 1-D tensor of a :data:`DTYPES` dtype, length a multiple of
    ``run``) encoded as a uint8 tensor of :func:`encoded_bytes` bytes. ``ValueError``
    for another dtype or length, or a value that is not finite."""
    if raw.dim() != 1:
        raise ValueError(f"fp8: a {raw.dim()}-D tensor is not one chunk")
    encoded, finite = encode_batch(raw.view(1, -1), run)
    if not bool(finite.all()):
        raise ValueError("fp8: a KV value is not finite")
    return encoded.view(-1)


def encode_batch(raw: torch.Tensor, run: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``raw`` (``chunks x elements`` of a :data:`DTYPES` dtype, on any
    device, ``elements`` a multiple of ``run``) encoded: a uint8 tensor of ``chunks x``
    :func:`encoded_bytes`, and a bool tensor, per chunk, whether every value of it was
    finite (a chunk that was not must not be stored). Nothing here waits for the
    device: the caller reads the flags once the work is done (a GPU's store).
    ``ValueError`` for another dtype or shape."""
    if raw.dtype not in DTYPES or raw.dim() != 2 or run <= 0 or raw.shape[1] % run:
        shape = tuple(raw.shape)
        raise ValueError(f"fp8: {raw.dtype} x {shape} is not runs of {run} of a 16/32-bit KV")
    chunks = raw.shape[0]
    rows = raw.reshape(chunks, -1, run).float()
    finite = torch.isfinite(rows).flatten(1).all(dim=1)
    scale = rows.abs().amax(dim=2) / E4M3_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (rows / safe[:, :, None]).to(torch.float8_e4m3fn)
    encoded = torch.cat(
        [scale.contiguous().view(torch.uint8), q.reshape(chunks, -1).view(torch.uint8)], dim=1
    )
    return encoded, finite


def decode(
    data: torch.Tensor, dtype: torch.dtype, run: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The values :func:`encode` encoded, as ``dtype`` (written into ``out`` if given).
    ``ValueError`` when ``data`` is not a whole number of runs."""
    values = decode_batch(data.view(1, -1), dtype, run, None if out is None else out.view(1, -1))
    return values.view(-1)


def decode_batch(
    data: torch.Tensor, dtype: torch.dtype, run: int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Each row of ``data`` (``chunks x`` encoded bytes, uint8, any device) decoded
    as ``dtype`` (``chunks x elements``; written into ``out`` if given). ``ValueError``
    when a row is not a whole number of runs."""
    chunks, n = data.shape
    elements = n * run // (run + 4)
    if n != encoded_bytes(elements, run):
        raise ValueError(f"fp8: {n} bytes are not runs of {run}")
    runs = elements // run
    scale = data[:, : 4 * runs].contiguous().view(torch.float32)
    q = data[:, 4 * runs :].contiguous().view(torch.float8_e4m3fn).view(chunks, runs, run)
    values = (q.float() * scale[:, :, None]).view(chunks, elements)
    if out is None:
        return values.to(dtype)
    out.copy_(values)
    return out


def within_bound(raw: torch.Tensor, decoded: torch.Tensor, run: int) -> bool:
    """Whether every decoded value is within the module docstring's bound of ``raw``."""
    rows = raw.view(-1, run).float()
    got = decoded.view(-1, run).float()
    scale = rows.abs().amax(dim=1, keepdim=True) / E4M3_MAX
    limit = (2.0**-4 + _OUTPUT_ROUNDING[raw.dtype] * 1.07) * rows.abs() + 2.0**-10 * scale
    return bool(((got - rows).abs() <= limit * (1 + 1e-6) + 1e-30).all())
