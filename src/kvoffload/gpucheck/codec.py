"""The fp8 chunk codec through the transfer worker (issue 33, decision 0023): on a
GPU it encodes before the copy to host and decodes after it
(:class:`~kvoffload.transfer.cuda_codec_copy.CudaCodecCopier`); on the CPU in the
copy threads.

Per dtype (bfloat16, float16, float32), :func:`run_case`:

1. builds fake KV caches (``gpu_style`` layout, finite values over four decades) on
   the device, a worker with ``codec`` fp8 over a page-locked slab of encoded slots
   (on CUDA), and a plain worker over a slab of raw slots;
2. stores ``chunks`` chunks and loads them back into other blocks through each,
   ``rounds`` times, timing each job pair (medians): raw GB/s of the plain copies and
   of the fp8 ones, their ratio, and the slot bytes of each;
3. checks that every block loaded through fp8 is within e4m3's bound of what was
   stored (``codecs/fp8.py``: :func:`~kvoffload.codecs.fp8.within_bound`, per chunk
   of its runs), and that the plain copies are bit-exact.

Every fp8 chunk carries a checksum (issue 41: sealed on the host once a store's copy
is done, checked on the host before a load's copy), so the timings include it. It is
xxh3-64, as kvoffload writes it, where xxhash is installed; this script needs only
torch and numpy, so without xxhash it checksums with blake2b (the stdlib's; slower)
and the entry's ``checksum`` says which.

A case never raises: an exception is a failed case whose ``error`` says why.
"""

from __future__ import annotations

import hashlib
import statistics
import time

import torch

from kvoffload.codecs import fp8
from kvoffload.codecs.chunk_codec import Fp8Chunks, fp8_run
from kvoffload.codecs.frame_check import Digest, xxh3
from kvoffload.core.jobs import JobKind
from kvoffload.gpucheck.jobs import engine_job, finish, submit
from kvoffload.gpucheck.report import Budget, Entry, Report
from kvoffload.gpucheck.slabs import host_slab
from kvoffload.transfer.layout import register_kv_caches
from kvoffload.transfer.worker import TransferWorker

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def run_all(report: Report, device: torch.device, budget: Budget, *, chunks: int = 8) -> None:
    """Every dtype on ``device`` into ``report.codec``."""
    for dtype in DTYPES:
        if budget.expired():
            report.skip(f"codec:{device.type}", "time budget")
            break
        entry = run_case(device, dtype, chunks=chunks)
        report.codec.append(entry)
        if not entry["ok"]:
            report.say(f"FAILED codec {entry}")
        else:
            report.say(
                f"fp8 on {device.type} {entry['dtype']}: {entry['fp8_gbps']:.2f} GB/s vs "
                f"{entry['plain_gbps']:.2f} plain (raw bytes, store + load), slots "
                f"{entry['slot_ratio']:.2f}x smaller, within e4m3's bound, frames "
                f"checksummed ({entry['checksum']})"
            )


def run_case(device: torch.device, dtype: torch.dtype, *, chunks: int, rounds: int = 3) -> Entry:
    entry: Entry = {"device": device.type, "dtype": str(dtype).removeprefix("torch.")}
    try:
        entry.update(_measure(device, dtype, chunks, rounds))
        entry["ok"], entry["error"] = True, None
    except Exception as exc:
        entry["ok"], entry["error"] = False, f"{type(exc).__name__}: {exc}"
    return entry


def _caches(device: torch.device, dtype: torch.dtype, blocks: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    caches = {}
    for i in range(4):
        shape = (2, blocks, 16, 8, 64)
        values = torch.randn(shape, generator=g) * 10 ** torch.randint(-2, 2, shape, generator=g)
        caches[f"layer{i}"] = values.to(dtype).to(device)
    return caches


def _blake2b(payload: memoryview) -> int:
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")


def checksum() -> tuple[str, Digest]:
    """The frames' checksum where xxhash is installed, else blake2b (see above)."""
    try:
        import xxhash  # noqa: F401
    except ImportError:
        return "blake2b (xxhash not installed)", _blake2b
    return "xxh3", xxh3


def _measure(device: torch.device, dtype: torch.dtype, chunks: int, rounds: int) -> Entry:
    k, blocks = 2, 4 * chunks + 4
    caches = _caches(device, dtype, blocks)
    layout = register_kv_caches(caches, blocks)
    raw = layout.chunk_bytes(k)
    digest_name, digest = checksum()
    codec = Fp8Chunks(dtype, raw, digest=digest)
    pinned = device.type == "cuda"
    plain = TransferWorker(layout, host_slab(raw, chunks, pinned=pinned), k, threads=1)
    coded = TransferWorker(
        layout, host_slab(codec.stored_bytes, chunks, pinned=pinned), k, threads=1, codec=codec
    )
    sources = list(range(chunks * k))
    targets = list(range(chunks * k, 2 * chunks * k))
    seconds: dict[str, list[float]] = {"plain": [], "fp8": []}
    try:
        before = {name: t[:, sources].clone() for name, t in caches.items()}
        for _ in range(rounds):
            for name, worker in (("plain", plain), ("fp8", coded)):
                begin = time.perf_counter()
                store = engine_job(JobKind.STORE, range(chunks), sources, k)
                submit(worker, store)
                finish(worker, [store])
                load = engine_job(JobKind.LOAD, range(chunks), targets, k)
                submit(worker, load)
                finish(worker, [load])
                seconds[name].append(time.perf_counter() - begin)
                _check(caches, before, targets, name, codec=codec, k=k)
    finally:
        plain.shutdown()
        coded.shutdown()
    moved = 2 * chunks * raw  # raw bytes stored and loaded
    plain_gbps = moved / statistics.median(seconds["plain"]) / 1e9
    fp8_gbps = moved / statistics.median(seconds["fp8"]) / 1e9
    return {
        "chunk_bytes": raw,
        "slot_bytes": codec.stored_bytes,
        "slot_ratio": raw / codec.stored_bytes,
        "plain_gbps": plain_gbps,
        "fp8_gbps": fp8_gbps,
        "fp8_over_plain": fp8_gbps / plain_gbps,
        "checksum": digest_name,
    }


def _check(
    caches: dict[str, torch.Tensor],
    before: dict[str, torch.Tensor],
    targets: list[int],
    name: str,
    *,
    codec: Fp8Chunks,
    k: int,
) -> None:
    """The loaded blocks against what was stored: bit-exact plain, within the bound fp8
    (per layer tensor and chunk: a chunk's runs lie within one page of one layer in
    this layout, so the bound per element holds for any grouping of whole runs)."""
    for layer, t in caches.items():
        got, want = t[:, targets].cpu(), before[layer].cpu()
        if name == "plain":
            if not torch.equal(got, want):
                raise AssertionError(f"plain copy: {layer} differs after the round trip")
            continue
        for c in range(len(targets) // k):
            a = want[:, c * k : (c + 1) * k].reshape(-1)
            b = got[:, c * k : (c + 1) * k].reshape(-1)
            if not fp8.within_bound(a, b, fp8_run(a.numel(), codec.run)):
                raise AssertionError(f"fp8: {layer} chunk {c} is not within e4m3's bound")
