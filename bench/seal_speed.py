"""Sealing's cost per core: seal and open GB/s against memcpy on the same chunks
(issue 41, decision 0024).

For each chunk size (``--chunk-kib``, default 1024 and 64), on one thread:

- ``memcpy``: a copy of the chunk into another buffer (the limit: the least any pass
  over the bytes costs; the tier lane copies each chunk at least once anyway);
- ``seal``: :meth:`kvoffload.sealing.sealer.Sealer.seal_into` (AES-256-GCM, a fresh
  nonce, the prefix and associated data), into a buffer of the sealed size;
- ``open``: :meth:`~kvoffload.sealing.sealer.Sealer.open_into` of that sealed chunk;
- ``xxh3``: the unkeyed checksum every lower-tier value carries (what an unsealed
  tier already pays per chunk).

Rounds interleave the four (``--rounds``, default 7); each round times ``--repeat``
calls (default: enough for about 64 MiB) and reports GB/s of plaintext. Printed: the
median GB/s of each and its ratio to memcpy's median. ``--json``: one JSON line.

    PYTHONPATH=src python bench/seal_speed.py [--chunk-kib 1024,64] [--rounds 7] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from tempfile import TemporaryDirectory

import xxhash

from kvoffload.sealing.keyfile import write_new
from kvoffload.sealing.layout import SEAL_BYTES, SealContext
from kvoffload.sealing.sealer import Sealer

CONTEXT = SealContext(namespace=os.urandom(16), storage_key=os.urandom(16))


def timed(call: Callable[[], object], repeat: int, nbytes: int) -> float:
    """GB/s of ``repeat`` calls moving ``nbytes`` each."""
    start = time.perf_counter()
    for _ in range(repeat):
        call()
    return repeat * nbytes / (time.perf_counter() - start) / 1e9


def measure(sealer: Sealer, chunk: int, rounds: int) -> dict[str, float]:
    plain = memoryview(bytearray(os.urandom(chunk)))
    copy = memoryview(bytearray(chunk))
    sealed = memoryview(bytearray(chunk + SEAL_BYTES))
    back = memoryview(bytearray(chunk))
    sealer.seal_into(plain, sealed, CONTEXT)
    repeat = max(8, (64 << 20) // chunk)

    def memcpy() -> None:
        copy[:] = plain

    calls: dict[str, Callable[[], object]] = {
        "memcpy": memcpy,
        "seal": lambda: sealer.seal_into(plain, sealed, CONTEXT),
        "open": lambda: sealer.open_into(sealed, back, CONTEXT),
        "xxh3": lambda: xxhash.xxh3_64_intdigest(plain),
    }
    samples: dict[str, list[float]] = {name: [] for name in calls}
    for r in range(rounds):
        order = list(calls) if r % 2 == 0 else list(reversed(calls))
        for name in order:
            samples[name].append(timed(calls[name], repeat, chunk))
    assert bytes(back) == bytes(plain)
    return {name: statistics.median(v) for name, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunk-kib", default="1024,64")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with TemporaryDirectory() as tmp:
        sealer = Sealer(write_new(Path(tmp) / "seal.key"))
    results = {}
    for kib in (int(k) for k in args.chunk_kib.split(",")):
        results[kib] = measure(sealer, kib * 1024, args.rounds)
    if args.json:
        print(json.dumps({"chunk_kib": results}))
        return
    print(f"sealing on one core: medians of {args.rounds} interleaved rounds, GB/s of plaintext")
    for kib, speeds in results.items():
        line = ", ".join(
            f"{name} {gbps:.2f} ({gbps / speeds['memcpy']:.2f}x memcpy)"
            for name, gbps in speeds.items()
        )
        print(f"  {kib} KiB chunks: {line}")


if __name__ == "__main__":
    main()
