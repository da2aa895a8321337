"""What the codec frames' checksum costs (issue 41): encode and decode time per chunk
of the slot codecs the worker runs (``kvoffload.codecs.chunk_codec``: lossless and
fp8 into and out of a tier slot), with the frame's xxh3-64 checksum and with it
replaced by a constant (the same code, nothing hashed), against a plain copy of the
chunk in the same run.

KV: the demo model's (``bench/codecs.py``'s ``model_kv``: a forward pass over random
tokens, vLLM's CPU page order) in bfloat16 and float32; chunks of ``--chunk-kib``
(64 and 1024 by default); one thread (``torch.set_num_threads(1)``). Medians over
``--rounds`` interleaved rounds of every chunk of the KV; per chunk in microseconds.
The checksum alone (xxh3-64 over a chunk's encoded bytes) is timed too.

    PYTHONPATH=src python bench/codec_frame_check.py [--rounds 7] [--chunk-kib 64,1024]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import xxhash

from kvoffload.codecs.chunk_codec import ChunkCodec, Fp8Chunks, LosslessChunks


def _model_kv(dtype: torch.dtype, tokens: int) -> bytes:
    """``bench/codecs.py``'s model KV (loaded by path: its name is the stdlib's)."""
    spec = importlib.util.spec_from_file_location(
        "bench_codecs", Path(__file__).with_name("codecs.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kv: bytes = module.model_kv(dtype, tokens)
    return kv


def _no_checksum(payload: memoryview) -> int:
    return 0


def slot_codecs(dtype: torch.dtype, raw: int) -> dict[str, ChunkCodec]:
    """Each codec with its checksum, and with a constant in its place."""
    return {
        "lossless": LosslessChunks(dtype.itemsize, raw),
        "lossless, no checksum": LosslessChunks(dtype.itemsize, raw, digest=_no_checksum),
        "fp8": Fp8Chunks(dtype, raw),
        "fp8, no checksum": Fp8Chunks(dtype, raw, digest=_no_checksum),
    }


def _each(fn: Callable[[int], object], n: int) -> float:
    """Seconds for ``fn(i)`` over ``i`` in ``range(n)``."""
    start = time.perf_counter()
    for i in range(n):
        fn(i)
    return time.perf_counter() - start


def measure(data: bytes, dtype: torch.dtype, chunk: int, rounds: int) -> dict[str, Any]:
    """Per codec: median encode and decode microseconds per chunk, the checksum's
    own, and a plain copy's (see the module docstring)."""
    n = len(data) // chunk
    raws = [torch.frombuffer(bytearray(data[i * chunk : (i + 1) * chunk]), dtype=torch.uint8)
            for i in range(n)]  # fmt: skip
    table = slot_codecs(dtype, chunk)
    slots = {name: torch.zeros((n, c.stored_bytes), dtype=torch.uint8) for name, c in table.items()}
    out = torch.empty(chunk, dtype=torch.uint8)
    samples: dict[str, list[float]] = {"copy": []}
    for _ in range(rounds):
        samples["copy"].append(_each(lambda i: out.copy_(raws[i]), n))
        for name, codec in table.items():
            s = slots[name]
            samples.setdefault(f"{name} encode", []).append(
                _each(lambda i, c=codec, s=s: c.encode(raws[i], s[i]), n)
            )
            samples.setdefault(f"{name} decode", []).append(
                _each(lambda i, c=codec, s=s: c.decode(s[i], out), n)
            )
            if not name.endswith("no checksum"):
                views = [s[i].numpy().data[: codec.used_bytes(s[i].numpy().data)] for i in range(n)]
                samples.setdefault(f"{name} xxh3 alone", []).append(
                    _each(lambda i, v=views: xxhash.xxh3_64_intdigest(v[i]), n)
                )
        for i in range(n):  # lossless is exact through its slot
            table["lossless"].decode(slots["lossless"][i], out)
            assert torch.equal(out, raws[i])
    return {name: statistics.median(t) / n * 1e6 for name, t in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--chunk-kib", default="64,1024")
    parser.add_argument("--tokens", type=int, default=2048, help="model KV tokens per dtype")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = []
    for dtype in (torch.bfloat16, torch.float32):
        kv = _model_kv(dtype, args.tokens)
        for kib in (int(k) for k in args.chunk_kib.split(",")):
            us = measure(kv, dtype, kib * 1024, args.rounds)
            results.append({"dtype": str(dtype).removeprefix("torch."), "chunk_kib": kib, "us": us})
    if args.json:
        print(json.dumps(results, indent=1))
        return
    for r in results:
        us = r["us"]
        print(f"\n{r['dtype']} model KV, {r['chunk_kib']} KiB chunks, us per chunk "
              f"(plain copy {us['copy']:.1f} us)")  # fmt: skip
        print(f"  {'codec':<10} {'encode':>9} {'no check':>9} {'decode':>9} {'no check':>9} "
              f"{'xxh3 alone':>10} {'dec +%':>7}")  # fmt: skip
        for codec in ("lossless", "fp8"):
            enc, dec = us[f"{codec} encode"], us[f"{codec} decode"]
            enc0, dec0 = us[f"{codec}, no checksum encode"], us[f"{codec}, no checksum decode"]
            print(f"  {codec:<10} {enc:9.1f} {enc0:9.1f} {dec:9.1f} {dec0:9.1f} "
                  f"{us[f'{codec} xxh3 alone']:10.1f} {100 * (dec / dec0 - 1):7.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
