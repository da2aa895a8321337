"""A fuzzer run spread over processes (``--jobs N``).

Shard ``k`` of ``N`` runs the seeds ``start + k, start + k + N, ...`` of the run's
range, in a process of its own (its own engine objects, scratch directory and
redis-server), and writes its counts to a JSON file the parent reads when the shard
ends. Failure reports and hang reports come out on the shard's output, which the
parent passes through unchanged. The parent's exit status is the worst of its
shards' (3 a hang, 1 a failure, else 0); a shard that died without a summary counts
as a failure.

Contract: :func:`run_shards` starts and waits for every shard it started and never
leaves one running: interrupted, it terminates each by its pid (a shard then closes
its redis-server and scratch directory, as at its end) and kills one that does not
end within 30 s.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class ShardTotals:
    """What a shard counted, or all shards together."""

    counts: Counter[str] = field(default_factory=Counter)  # passed, failed, sync, async
    stats: Counter[str] = field(default_factory=Counter)  # the coverage counters
    last_seed: int = -1

    def to_json(self) -> str:
        return json.dumps(
            {"counts": dict(self.counts), "stats": dict(self.stats), "last_seed": self.last_seed}
        )

    @classmethod
    def from_json(cls, text: str) -> ShardTotals:
        data = json.loads(text)
        return cls(Counter(data["counts"]), Counter(data["stats"]), int(data["last_seed"]))

    def add(self, other: ShardTotals) -> None:
        self.counts.update(other.counts)
        self.stats.update(other.stats)
        self.last_seed = max(self.last_seed, other.last_seed)


def shard_seeds(start: int, count: int | None, shard: int, shards: int) -> range:
    """The seeds of shard ``shard`` of ``shards`` (unbounded with ``count`` None)."""
    stop = start + count if count is not None else sys.maxsize
    return range(start + shard, stop, shards)


def parse_shard(text: str) -> tuple[int, int]:
    """``"k/N"`` -> (k, N), 0 <= k < N."""
    k, _, n = text.partition("/")
    shard, shards = int(k), int(n)
    if not 0 <= shard < shards:
        raise ValueError(f"shard {text!r}: want k/N with 0 <= k < N")
    return shard, shards


def run_shards(argv: list[str], jobs: int) -> tuple[int, ShardTotals]:
    """Run ``python -m kvoffload.testing.vllm_fuzz ARGV`` as ``jobs`` shards; the
    worst exit status and the summed totals."""
    totals = ShardTotals()
    worst = 0
    with tempfile.TemporaryDirectory(prefix="kvoffload-fuzz-shards-") as tmp:
        summaries = [Path(tmp) / f"shard{k}.json" for k in range(jobs)]
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for k, summary in enumerate(summaries):
                cmd = [sys.executable, "-m", "kvoffload.testing.vllm_fuzz", *argv]
                cmd += ["--shard", f"{k}/{jobs}", "--summary", str(summary)]
                procs.append(subprocess.Popen(cmd))
            for proc in procs:
                code = proc.wait()
                worst = max(worst, code if code in (1, 3) else (1 if code else 0))
        finally:
            for proc in procs:  # interrupted: each shard closes its redis-server first
                if proc.poll() is None:
                    proc.terminate()
            for proc in procs:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for summary in summaries:
            if not summary.exists():
                worst = max(worst, 1)
                print(f"fuzzer shard {summary.stem}: ended without a summary", flush=True)
                continue
            totals.add(ShardTotals.from_json(summary.read_text()))
    return worst, totals
