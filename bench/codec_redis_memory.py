"""Redis memory per chunk under each codec: what a Redis tier really holds per byte.

A private redis-server (``kvoffload.testing.redis_server``, killed by pid at the end)
per codec and chunk size; kvoffload's own Redis store writes ``--chunks`` chunks of
bfloat16 KV-like values (Gaussian, a random scale per chunk) as the engine would:

- ``none``: the raw chunk (the baseline), in a fixed-size store;
- ``fp8``: the fp8 slot (``codecs/chunk_codec.py``), fixed size;
- ``lossless``: the frame and its length, in a variable-size store (decision 0023).

Reported per codec: the bytes of the values (header and payload), the growth of the
server's ``used_memory``, the overhead (memory over values: the allocator's size
classes and Redis's own per-key cost), and chunks per MB of Redis memory against
``none``'s in the same run. Gaussian values are a floor for lossless (the demo
model's bfloat16 KV compresses as much: 1.45x, ``bench/codecs.py``).

    PYTHONPATH=src python bench/codec_redis_memory.py [--chunk-kib 64,1024] [--chunks 200]
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile

import torch

from kvoffload.codecs.chunk_codec import open_codec
from kvoffload.core.keys import ChunkKey
from kvoffload.testing.redis_server import RedisServer
from kvoffload.tiers.redis_client import RedisSettings, make_client
from kvoffload.tiers.redis_store import RedisStore

CODECS = ("none", "fp8", "lossless")
HEADER = 64


def chunk(raw: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    scale = float(torch.rand(1, generator=g)) * 4 + 0.1
    return (torch.randn(raw // 2, generator=g) * scale).to(torch.bfloat16).view(torch.uint8)


def measure(codec_name: str, raw: int, chunks: int) -> tuple[int, int]:
    """(bytes of the values written, growth of used_memory)."""
    codec = open_codec(codec_name, torch.bfloat16, raw)
    stored = raw if codec is None else codec.stored_bytes
    with tempfile.TemporaryDirectory() as root:
        server = RedisServer(pathlib.Path(root)).start()
        try:
            client = make_client(RedisSettings(server.url, timeout_ms=10_000))
            store = RedisStore(client, bytes(16), 0, stored, variable=codec_name == "lossless")
            before = int(server.client().info("memory")["used_memory"])
            written = 0
            for i in range(chunks):
                values = chunk(raw, i)
                if codec is None:
                    view = values.numpy().data
                else:
                    slot = torch.zeros(stored, dtype=torch.uint8)
                    codec.encode(values, slot)
                    view = slot.numpy().data[: codec.used_bytes(slot.numpy().data)]
                store.write_many([(ChunkKey(i.to_bytes(16, "big")), view)])
                written += HEADER + len(view)
            grown = int(server.client().info("memory")["used_memory"]) - before
        finally:
            server.kill()
    return written, grown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunk-kib", default="64,1024")
    parser.add_argument("--chunks", type=int, default=200)
    args = parser.parse_args()
    print("chunk    codec     values MB  used_memory MB  overhead  chunks/MB  vs none")
    for kib in (int(k) for k in args.chunk_kib.split(",")):
        raw = kib * 1024
        chunks = args.chunks if kib <= 64 else max(8, args.chunks // 4)
        per_mb: dict[str, float] = {}
        for name in CODECS:
            written, grown = measure(name, raw, chunks)
            per_mb[name] = chunks / (grown / 1e6)
            print(
                f"{kib:>5} KiB {name:<9} {written / 1e6:>9.2f} {grown / 1e6:>15.2f} "
                f"{grown / written - 1:>9.1%} {per_mb[name]:>10.2f} "
                f"{per_mb[name] / per_mb['none']:>7.2f}x"
            )


if __name__ == "__main__":
    main()
