"""Baselines for ``bench/tiers.py``: sequential O_DIRECT file I/O, ``dd``, ``redis-benchmark``.

- :func:`sequential_direct`: one file written then read front to back with
  ``O_DIRECT`` from one page-aligned (mmap) buffer of the chunk size, one request in
  flight, no fsync (the disk tier does not fsync either). The "dd-like" baseline.
- :func:`real_dd`: GNU ``dd`` with ``oflag=direct`` / ``iflag=direct``, same sizes.
- :func:`redis_benchmark`: ``redis-benchmark -t set,get`` requests/s at a value
  size, a number of connections and a pipeline depth, on one key or on new keys.
- :func:`throughput_table`: medians of GB/s and of per-run ratios to a baseline.
"""

from __future__ import annotations

import mmap
import os
import re
import shutil
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

GB = 1e9


@dataclass(frozen=True)
class Run:
    """Seconds of one run's write and read (None: that phase failed, see ``error``)."""

    write_s: float | None
    read_s: float | None
    error: str = ""

    def seconds(self, direction: int) -> float | None:
        return self.read_s if direction else self.write_s


Times = dict[str, list[Run]]  # method -> its runs, in order


def filesystem(path: Path) -> str:
    """``device fstype mountpoint`` of the filesystem holding ``path`` (from ``df``)."""
    out = subprocess.run(
        ["df", "--output=source,fstype,target", str(path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return " ".join(out.splitlines()[-1].split())


def evict_page_cache(path: Path) -> None:
    """Write ``path``'s dirty pages back and drop its cached pages (no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def sequential_direct(path: Path, block_bytes: int, count: int) -> tuple[float, float]:
    """Seconds to write, then to read, ``count`` blocks sequentially with O_DIRECT."""
    buf = mmap.mmap(-1, block_bytes)  # page-aligned, as O_DIRECT needs
    view = memoryview(buf)
    view[:] = os.urandom(block_bytes)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            begin = time.perf_counter()
            for _ in range(count):
                if os.write(fd, view) != block_bytes:
                    raise OSError("short O_DIRECT write")
            write_s = time.perf_counter() - begin
        finally:
            os.close(fd)
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            begin = time.perf_counter()
            for _ in range(count):
                if os.readv(fd, [view]) != block_bytes:
                    raise OSError("short O_DIRECT read")
            read_s = time.perf_counter() - begin
        finally:
            os.close(fd)
    finally:
        view.release()
        buf.close()
        path.unlink(missing_ok=True)
    return write_s, read_s


_DD_RATE = re.compile(r"^(\d+) bytes .* copied, ([0-9.eE+-]+) s", re.MULTILINE)


def real_dd(path: Path, block_bytes: int, count: int) -> tuple[float, float] | None:
    """Seconds GNU dd reports for the same write and read (None: no usable dd)."""
    if shutil.which("dd") is None:
        return None
    bs = f"bs={block_bytes}"
    try:
        runs = [
            ["dd", "if=/dev/zero", f"of={path}", bs, f"count={count}", "oflag=direct"],
            ["dd", f"if={path}", "of=/dev/null", bs, "iflag=direct"],
        ]
        seconds = []
        for cmd in runs:
            done = subprocess.run(cmd, capture_output=True, text=True, check=False)
            match = _DD_RATE.search(done.stderr)
            if done.returncode or match is None or int(match[1]) != block_bytes * count:
                return None
            seconds.append(float(match[2]))
    finally:
        path.unlink(missing_ok=True)
    return seconds[0], seconds[1]


def redis_benchmark(
    port: int,
    value_bytes: int,
    clients: int,
    pipeline: int,
    requests: int,
    *,
    tests: str = "set,get",
    fresh_keys: bool = False,
) -> dict[str, float]:
    """Requests/s of ``redis-benchmark -t <tests>``. By default every request uses its
    one fixed key, so each GET hits a value of ``value_bytes`` and each SET overwrites
    it in place. ``fresh_keys`` adds ``-r 10^9`` (redis-benchmark reads it as a C int:
    a larger keyspace silently disables it): every SET creates a new key, as a chunk
    store does, so the server allocates each value. Raises if it fails."""
    binary = shutil.which("redis-benchmark")
    if binary is None:
        raise RuntimeError("redis-benchmark is not installed")
    cmd = [binary, "-h", "127.0.0.1", "-p", str(port), "-t", tests, "-d", str(value_bytes)]
    cmd += ["-c", str(clients), "-P", str(pipeline), "-n", str(requests), "--csv", "-q"]
    if fresh_keys:
        cmd += ["-r", str(10**9)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600).stdout
    rps: dict[str, float] = {}
    for line in out.splitlines():
        fields = [f.strip('"') for f in line.split(",")]
        if len(fields) >= 2 and fields[0] in ("SET", "GET"):
            rps[fields[0]] = float(fields[1])
    if set(rps) != set(tests.upper().split(",")):
        raise RuntimeError(f"unexpected redis-benchmark output: {out!r}")
    return rps


def throughput_table(times: Times, base: str, nbytes: int, targets: dict[str, float]) -> list[str]:
    """Median GB/s per method and direction, and the median of its per-run ratios to
    ``base``; a failed phase shows as 'failed' and its errors are listed below."""
    head = f"  {'method':<24}{'write GB/s':>11}{'read GB/s':>10}{'write/base':>11}{'read/base':>10}"
    lines, errors = [head], []
    for method, runs in times.items():
        cells, ratios = [], []
        for d in (0, 1):
            secs = [r.seconds(d) for r in runs]
            done = [nbytes / GB / s for s in secs if s]
            pairs = zip(secs, (b.seconds(d) for b in times[base]), strict=True)
            ok = [b / s for s, b in pairs if s and b]  # this run's baseline time / ours
            cells.append(f"{statistics.median(done):.2f}" if done else "failed")
            ratios.append(statistics.median(ok) if ok else None)
        target = targets.get(method)
        line = f"  {method:<24}{cells[0]:>11}{cells[1]:>10}"
        line += "".join(f"{r:>10.2f}x" if r is not None else f"{'-':>11}" for r in ratios)
        if target:
            met = ["met" if r is not None and r >= target else "MISSED" for r in ratios]
            line += f"  target >= {target:.2f}: write {met[0]}, read {met[1]}"
        lines.append(line)
        errors += sorted({f"{method}: {r.error}" for r in runs if r.error and method != base})
    return lines + [f"  error in {e}" for e in errors]
