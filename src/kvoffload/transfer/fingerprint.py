"""Content checksums of tensors where they live, and a fingerprint of named tensors.

Used to fingerprint the weights a worker serves (``adapters/vllm/live_identity.py``,
decision 0019). Each tensor's bytes are read as 64-bit words on its own device (no
copy to the host) and reduced to two sums modulo 2**64: the plain sum and the sum of
each word times its position plus one. Integer sums are exact and order-free, so the
result is the same on every device and run for the same bytes; the positional sum
changes when words move (a permutation). Any change of a tensor's bytes that is not
a sum-preserving rearrangement changes its checksum (a weight update scales, adds or
overwrites: it does). Not a cryptographic hash: the threat it answers is stale KV,
not an adversary (same-user processes are trusted, decision 0018).

Cost: each tensor is read about three times (the two sums and the positions), in
pieces of :data:`PIECE_WORDS` words so the temporaries stay small; one transfer to
the host for all tensors at the end. Measured in decision 0019.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

PIECE_WORDS = 1 << 22
"""Words reduced at a time (32 MiB of int64 temporaries per piece)."""

_FORMAT = b"kvoffload/tensor-fingerprint/v1"


def checksum(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes as two int64 sums on its device (a ``[2]`` tensor); a
    tensor without readable storage (meta) sums to zeros, one whose bytes cannot be
    viewed to -1s, on the host (such a tensor's changes are not seen)."""
    device = tensor.device
    if device.type == "meta":
        return torch.zeros(2, dtype=torch.int64)  # no bytes to read: on the host
    if tensor.numel() == 0:
        return torch.zeros(2, dtype=torch.int64, device=device)
    try:
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    except (RuntimeError, TypeError):  # a tensor whose bytes cannot be viewed (sparse)
        return torch.full((2,), -1, dtype=torch.int64)
    whole = raw.numel() // 8 * 8
    words = raw[:whole].view(torch.int64)
    total = torch.zeros(2, dtype=torch.int64, device=device)
    for start in range(0, words.numel(), PIECE_WORDS):
        piece = words[start : start + PIECE_WORDS]
        positions = torch.arange(
            start + 1, start + 1 + piece.numel(), dtype=torch.int64, device=device
        )
        total[0] += piece.sum()
        total[1] += (piece * positions).sum()
    if whole < raw.numel():  # the last bytes of a size not a multiple of 8
        tail = raw[whole:].to(torch.int64)
        total[0] += tail.sum()
        total[1] += (tail * 257).sum()
    return total


def fingerprint(tensors: Iterable[tuple[str, torch.Tensor]], extra: bytes = b"") -> bytes:
    """A 16-byte fingerprint of named tensors (each name, dtype, shape and
    :func:`checksum`, in the order given) and of ``extra`` (what else the caller
    identifies: e.g. module attributes)."""
    names: list[bytes] = []
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for name, tensor in tensors:
        by_device.setdefault(tensor.device, []).append((len(names), checksum(tensor)))
        names.append(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}".encode())
    sums: list[bytes] = [b""] * len(names)
    for pairs in by_device.values():  # one transfer per device, after every reduction
        host = torch.stack([pair for _, pair in pairs]).cpu().numpy()
        for row, (index, _) in enumerate(pairs):
            sums[index] = host[row].tobytes()
    h = hashlib.blake2b(_FORMAT, digest_size=16)
    for label, pair in zip(names, sums, strict=True):
        h.update(len(label).to_bytes(4, "little") + label)
        h.update(pair)
    h.update(len(extra).to_bytes(8, "little") + extra)
    return h.digest()
