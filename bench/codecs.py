"""Chunk codecs on KV bytes: ratio and encode/decode speed against a plain copy.

For each KV dtype (bfloat16, float16, float32) and each source of KV:

- ``model``: the demo model's (``kvoffload.demos.tiny_model``, random weights) keys
  and values from a forward pass over random token ids (``transformers``), laid out
  as vLLM's CPU layout pages them (per layer and block: heads x block x 2*head_dim);
- ``gaussian``: values drawn from N(0, 1) (a floor: no structure at all),

each codec encodes and decodes chunks of ``--chunk-kib`` (64 and 1024 by default):

- ``copy``: ``torch`` copy of the bytes (the limit: what storing without a codec costs);
- ``zstd-N``: byte planes shuffled (numpy), then zstandard level N (lossless);
- ``lz4``: byte planes shuffled, then lz4 frame (lossless);
- ``blosc2-zstd`` / ``blosc2-lz4``: blosc2 with its shuffle filter and that coder,
  one thread (lossless);
- ``fp8``: ``kvoffload.codecs.fp8`` (e4m3, a scale per 4,096 elements; lossy).

Prints, per dtype and source, each codec's ratio (raw / encoded) and its encode and
decode speed in raw GB/s (medians over ``--rounds`` interleaved rounds), the ratio of
its encode time to a copy's, and the byte planes' Shannon entropy (bits per byte:
sign+exponent plane against mantissa planes; random weights give near-random
mantissas, so lossless ratios here understate a trained model's).

    PYTHONPATH=src python bench/codecs.py [--rounds 5] [--chunk-kib 64,1024] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvoffload.codecs import fp8

Codec = tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]


def shuffled(data: bytes, width: int) -> bytes:
    return np.frombuffer(data, np.uint8).reshape(-1, width).T.tobytes()


def unshuffled(data: bytes, width: int) -> bytes:
    return np.frombuffer(data, np.uint8).reshape(width, -1).T.tobytes()


def codecs(width: int, dtype: torch.dtype) -> dict[str, Codec]:
    out: dict[str, Codec] = {}
    import lz4.frame
    import zstandard

    for level in (1, 3):
        c, d = zstandard.ZstdCompressor(level=level), zstandard.ZstdDecompressor()
        out[f"zstd-{level}"] = (
            lambda b, c=c: c.compress(shuffled(b, width)),
            lambda b, d=d: unshuffled(d.decompress(b), width),
        )
    out["lz4"] = (
        lambda b: lz4.frame.compress(shuffled(b, width)),
        lambda b: unshuffled(lz4.frame.decompress(b), width),
    )
    import blosc2

    for name, coder in (("zstd", blosc2.Codec.ZSTD), ("lz4", blosc2.Codec.LZ4)):
        cparams = {"codec": coder, "clevel": 1, "typesize": width, "nthreads": 1,
                   "filters": [blosc2.Filter.SHUFFLE]}  # fmt: skip
        out[f"blosc2-{name}"] = (
            lambda b, p=cparams: blosc2.compress2(b, **p),
            blosc2.decompress2,
        )
    out["fp8"] = (
        lambda b: fp8.encode(torch.frombuffer(bytearray(b), dtype=dtype), 4096).numpy().tobytes(),
        lambda b: fp8.decode(torch.frombuffer(bytearray(b), dtype=torch.uint8), dtype, 4096)
        .view(torch.uint8).numpy().tobytes(),
    )  # fmt: skip
    return out


def model_kv(dtype: torch.dtype, tokens: int) -> bytes:
    """The demo model's K and V for ``tokens`` random tokens, in vLLM's CPU page order."""
    from transformers import AutoModelForCausalLM

    from kvoffload.demos.tiny_model import ensure_model

    path = ensure_model("demo")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    ids = torch.randint(
        4, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    pages = []
    block = 32
    layers = [(cache.layers[i].keys, cache.layers[i].values) for i in range(len(cache.layers))]
    for b in range(tokens // block):
        for k, v in layers:  # [1, heads, tokens, dim]
            kv = torch.cat(
                [k[0, :, b * block : (b + 1) * block], v[0, :, b * block : (b + 1) * block]], -1
            )
            pages.append(kv.contiguous().view(torch.uint8).numpy().tobytes())
    return b"".join(pages)


def gaussian(dtype: torch.dtype, nbytes: int) -> bytes:
    n = nbytes // torch.empty((), dtype=dtype).element_size()
    return (
        torch.randn(n, generator=torch.Generator().manual_seed(1))
        .to(dtype)
        .view(torch.uint8)
        .numpy()
        .tobytes()
    )


def entropy(data: bytes, width: int) -> list[float]:
    planes = np.frombuffer(data, np.uint8).reshape(-1, width)
    out = []
    for p in range(width):
        counts = np.bincount(planes[:, p], minlength=256).astype(float)
        prob = counts[counts > 0] / counts.sum()
        out.append(float(-(prob * np.log2(prob)).sum()))
    return out


def timed(fn: Callable[[bytes], bytes], chunks: list[bytes]) -> tuple[float, list[bytes]]:
    start = time.perf_counter()
    out = [fn(c) for c in chunks]
    return time.perf_counter() - start, out


def measure(data: bytes, dtype: torch.dtype, chunk: int, rounds: int) -> dict[str, Any]:
    width = torch.empty((), dtype=dtype).element_size()
    chunks = [data[i : i + chunk] for i in range(0, len(data) - chunk + 1, chunk)]
    raw = sum(len(c) for c in chunks)
    table = codecs(width, dtype)
    times: dict[str, list[tuple[float, float]]] = {n: [] for n in ["copy", *table]}
    ratio: dict[str, float] = {}
    for _ in range(rounds):
        start = time.perf_counter()
        for c in chunks:
            torch.frombuffer(bytearray(c), dtype=torch.uint8).clone()
        copy = time.perf_counter() - start
        times["copy"].append((copy, copy))
        for name, (enc, dec) in table.items():
            t_enc, encoded = timed(enc, chunks)
            t_dec, decoded = timed(dec, encoded)
            ratio[name] = raw / sum(len(e) for e in encoded)
            if name != "fp8":
                assert decoded == chunks, f"{name} is not lossless"
            times[name].append((t_enc, t_dec))
    out: dict[str, Any] = {}
    for name, samples in times.items():
        enc = statistics.median(s[0] for s in samples)
        dec = statistics.median(s[1] for s in samples)
        out[name] = {
            "ratio": ratio.get(name, 1.0),
            "encode_gbps": raw / enc / 1e9,
            "decode_gbps": raw / dec / 1e9,
            "encode_vs_copy": enc / statistics.median(s[0] for s in times["copy"]),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--chunk-kib", default="64,1024")
    parser.add_argument("--tokens", type=int, default=1024, help="model KV tokens per dtype")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    results: list[dict[str, Any]] = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        width = torch.empty((), dtype=dtype).element_size()
        kv = model_kv(dtype, args.tokens)
        for source, data in (("model", kv), ("gaussian", gaussian(dtype, len(kv)))):
            for kib in (int(k) for k in args.chunk_kib.split(",")):
                r = measure(data, dtype, kib * 1024, args.rounds)
                entry = {"dtype": str(dtype).split(".")[1], "source": source, "chunk_kib": kib}
                entry.update(plane_entropy_bits=entropy(data, width), codecs=r)
                results.append(entry)
    if args.json:
        print(json.dumps(results, indent=1))
        return
    for res in results:
        planes = " ".join(f"{e:.2f}" for e in res["plane_entropy_bits"])
        print(f"\n{res['dtype']} {res['source']} KV, {res['chunk_kib']} KiB chunks "
              f"(byte-plane entropy, low to high byte: {planes} bits)")  # fmt: skip
        print(f"  {'codec':<12} {'ratio':>6} {'enc GB/s':>9} {'dec GB/s':>9} {'enc/copy':>9}")
        for name, c in res["codecs"].items():
            print(f"  {name:<12} {c['ratio']:6.3f} {c['encode_gbps']:9.2f} {c['decode_gbps']:9.2f} "
                  f"{c['encode_vs_copy']:9.1f}")  # fmt: skip
    assert all(math.isfinite(c["ratio"]) for r in results for c in r["codecs"].values())


if __name__ == "__main__":
    main()
