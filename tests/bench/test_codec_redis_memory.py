"""``bench/codec_redis_memory.py`` measures what it says: a lossless chunk takes its
encoded size in Redis (values smaller than raw ones) and fp8 half a bfloat16 chunk,
with the server's memory growth read from a real redis-server."""

from __future__ import annotations

from tests.bench_modules import bench_module


def test_each_codecs_values_and_memory_are_measured() -> None:
    bench = bench_module("codec_redis_memory")
    raw, chunks = 64 * 1024, 8
    sizes = {name: bench.measure(name, raw, chunks) for name in bench.CODECS}
    written = {name: w for name, (w, _) in sizes.items()}
    assert written["none"] == chunks * (raw + 64)
    assert written["fp8"] == chunks * (64 + 8 + raw // 2 + 4 * (raw // 2 // 4096))  # 8: checksum
    assert written["lossless"] < 0.8 * written["none"]  # Gaussian bfloat16: about 1.45x
    assert all(grown >= w for w, grown in sizes.values())  # Redis holds at least the values
