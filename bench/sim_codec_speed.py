"""The fp8 codec's speed on this CPU, against a copy: where ``kvoffload simulate``'s
fp8 defaults for ``--codec-encode-gbps`` / ``--codec-decode-gbps`` come from.

    PYTHONPATH=src nice -n 19 .venv/bin/python bench/sim_codec_speed.py [--threads 1]

Encodes and decodes bf16 tensors of 64 KiB to 4 MiB of N(0, 1) values with
:mod:`kvoffload.codecs.fp8` (e4m3, one fp32 absmax scale per run of 4,096 elements)
and copies them (``Tensor.copy_``: what storing without a codec costs). Speeds are
GB/s of raw (bf16) bytes, medians over ``--reps``; the last line is the median over
the sizes, the figure the simulator takes. Needs only torch (``bench/codecs.py``
compares every codec and needs the ``codecs`` extra). Not a test: the numbers vary
with the machine and its load.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from kvoffload.codecs import FP8_RUN, fp8

SIZES_KIB = (64, 256, 1024, 4096)


def _median_s(fn: Callable[[], object], reps: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} thread(s); GB/s of raw bf16 bytes")
    print(f"{'size':>8} {'copy':>8} {'encode':>8} {'decode':>8}")
    encodes, decodes = [], []
    for kib in SIZES_KIB:
        nbytes = kib * 1024
        x = torch.randn(nbytes // 2, dtype=torch.bfloat16)
        out = torch.empty_like(x)
        data = fp8.encode(x, FP8_RUN)
        assert fp8.within_bound(x, fp8.decode(data, torch.bfloat16, FP8_RUN), FP8_RUN)
        copy_s = _median_s(lambda: out.copy_(x), args.reps)  # noqa: B023
        enc_s = _median_s(lambda: fp8.encode(x, FP8_RUN), args.reps)  # noqa: B023
        dec_s = _median_s(lambda: fp8.decode(data, torch.bfloat16, FP8_RUN, out), args.reps)  # noqa: B023
        copy, enc, dec = (nbytes / s / 1e9 for s in (copy_s, enc_s, dec_s))
        encodes.append(enc)
        decodes.append(dec)
        print(f"{kib:>5}KiB {copy:>8.2f} {enc:>8.2f} {dec:>8.2f}")
    enc, dec = statistics.median(encodes), statistics.median(decodes)
    print(f"{'median':>8} {'':>8} {enc:>8.2f} {dec:>8.2f}")


if __name__ == "__main__":
    main()
