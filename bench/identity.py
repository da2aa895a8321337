"""The cost of identifying weights by content (decision 0019), against the limits
measured in the same run.

- **Weight files** (``core/identity/content_digest.py``, what an engine reads at its first start
  on a node): ``--files`` files of ``--file-gb`` GB of random bytes, digested in full
  with a fresh cache, against reading the same files into a buffer without hashing
  (the read alone: the floor for any content identity), both from the page cache
  (warm) and, with ``--cold`` (root: drops the page cache first), from the disk. Then
  the remembered digests of a restart (nothing read). The projection to 100 GB is
  the measured rate applied to 100 GB.
- **Live weights** (``transfer/fingerprint.py``, what a worker computes at start and
  after each reset of the prefix cache): tensors of ``--tensor-gb`` GB in total on the
  CPU, fingerprinted, against one ``torch.sum`` over the same bytes (one read).

Prints each rate and its ratio to its baseline. Usage:
``python bench/identity.py [--files 4] [--file-gb 1.0] [--tensor-gb 1.0] [--cold]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvoffload.core.identity.content_digest import READ_BYTES, DigestCache, digest_files
from kvoffload.transfer.fingerprint import fingerprint

GB = 1e9


def write_files(root: Path, count: int, size: int) -> list[Path]:
    paths = []
    chunk = os.urandom(1 << 24)
    for i in range(count):
        path = root / f"model-{i:05d}.safetensors"
        with open(path, "wb") as f:
            left = size
            while left > 0:
                n = min(left, len(chunk))
                f.write(chunk[:n])
                left -= n
        paths.append(path)
    return paths


def read_only(paths: list[Path]) -> None:
    """Every byte read into a buffer, nothing else (the baseline)."""
    buffer = bytearray(READ_BYTES)
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            while os.readv(fd, [buffer]):
                pass
        finally:
            os.close(fd)


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def timed(fn: object) -> float:
    start = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - start


def files_bench(args: argparse.Namespace) -> None:
    root = Path(tempfile.mkdtemp(prefix="kvoffload-identity-"))
    try:
        size = int(args.file_gb * GB)
        paths = write_files(root, args.files, size)
        total = size * len(paths) / GB
        modes = ["warm", "cold"] if args.cold else ["warm"]
        for mode in modes:
            reads, digests = [], []
            for _ in range(args.reps):  # interleaved: the machine's noise hits both
                if mode == "cold" and not drop_caches():
                    print("cold: cannot drop the page cache (not root); skipped")
                    break
                if mode == "warm":
                    read_only(paths)  # in the page cache
                reads.append(timed(lambda: read_only(paths)))
                if mode == "cold":
                    drop_caches()
                cache = DigestCache(root / f"cache-{len(digests)}-{mode}")
                digests.append(timed(lambda c=cache: digest_files(paths, c)))  # type: ignore[misc]
            if not reads:
                continue
            read_s, digest_s = statistics.median(reads), statistics.median(digests)
            print(
                f"weight files, {mode} ({len(paths)} x {args.file_gb:g} GB = {total:.1f} GB, "
                f"median of {len(reads)}): read only {total / read_s:.2f} GB/s, "
                f"digested {total / digest_s:.2f} GB/s "
                f"(ratio to the read {read_s / digest_s:.2f}); "
                f"100 GB would take {100 / (total / digest_s):.1f} s"
            )
        cache = DigestCache(root / "cache-remembered")
        digest_files(paths, cache)
        again = timed(lambda: digest_files(paths, cache))
        print(f"weight files, remembered (a restart): {again * 1e3:.2f} ms for {len(paths)} files")
    finally:
        shutil.rmtree(root, ignore_errors=True)


def tensors_bench(args: argparse.Namespace) -> None:
    count = 8
    each = int(args.tensor_gb * GB / 4 / count)
    tensors = [(f"layer{i}.weight", torch.randn(each)) for i in range(count)]
    total = each * 4 * count / GB
    sums, prints = [], []
    for _ in range(args.reps):
        sums.append(timed(lambda: [t.view(torch.int32).sum() for _, t in tensors]))
        prints.append(timed(lambda: fingerprint(tensors)))
    sum_s, print_s = statistics.median(sums), statistics.median(prints)
    print(
        f"live weights on the CPU ({total:.1f} GB, {torch.get_num_threads()} threads, median "
        f"of {args.reps}): one sum {total / sum_s:.2f} GB/s, fingerprint "
        f"{total / print_s:.2f} GB/s (ratio to the sum {sum_s / print_s:.2f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--file-gb", type=float, default=1.0)
    parser.add_argument("--tensor-gb", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cold", action="store_true", help="also from the disk (root)")
    args = parser.parse_args()
    files_bench(args)
    tensors_bench(args)


if __name__ == "__main__":
    main()
