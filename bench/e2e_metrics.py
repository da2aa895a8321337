"""kvoffload's own counters and transfer histograms, read from an in-process engine.

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so
kvoffload's scheduler half is reachable from the ``LLM`` object and its
:class:`~kvoffload.core.observe.recorder.MetricsRecorder` holds every series it exports
(the directory's and the lower tiers' counters are rebound onto it): the same
numbers its Prometheus endpoint and vLLM's ``/metrics`` show. A run reads it
after the warm-up and again after the workload (:func:`settle` first, so stores
and spills still in flight are counted) and keeps the difference
(:class:`Counts`).

Transfer throughput comes from the ``transfer_bytes`` / ``transfer_seconds``
histograms (one observation per job and worker, ``observe_transfer`` in
``core/observe/recorder.py``): GB/s = bytes moved / seconds the jobs took, chunks/s =
``transferred_chunks_total`` / those seconds. Jobs of one tier can run on several
tier threads at once, so this is the per-job rate, not wall-clock bandwidth.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvoffload.core.observe.metrics import BY_NAME, Series
from kvoffload.demos.vllm_runner import RunResult, open_engine, run_batches, warm_up

EVICTED_WITHOUT_COPY = "evicted_without_copy_total"
GB = 1e9


def scheduler_half(llm: Any) -> Any | None:
    """kvoffload's scheduler half, or None when the engine's connector is not kvoffload's."""
    core = llm.llm_engine.engine_core.engine_core
    side = getattr(getattr(core.scheduler, "connector", None), "scheduler_side", None)
    return getattr(side, "scheduler", None)


def settle(llm: Any, timeout_s: float = 60.0) -> bool:
    """Step the idle engine until kvoffload has nothing in flight or queued (as vLLM's
    engine loop keeps stepping while a connector has work); False on timeout."""
    half = scheduler_half(llm)
    if half is None:
        return True
    core = llm.llm_engine.engine_core.engine_core
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not (core.scheduler.has_requests() or half.has_pending_work()):
            return True
        llm.llm_engine.step()
        time.sleep(0.002)  # worker threads finishing their jobs
    return False


@dataclass(frozen=True)
class Reading:
    counters: dict[Series, int]
    histograms: dict[Series, tuple[float, int]]  # (sum, count)


def read(llm: Any) -> Reading | None:
    half = scheduler_half(llm)
    if half is None:
        return None
    m = half.metrics
    return Reading(dict(m.counters), {k: (h.total, h.count) for k, h in m.histograms.items()})


@dataclass(frozen=True)
class Counts:
    """What grew between two readings; ``settled``: the jobs drained before the second."""

    counters: dict[Series, int] = field(default_factory=dict)
    histograms: dict[Series, tuple[float, int]] = field(default_factory=dict)
    settled: bool = True

    @classmethod
    def between(cls, before: Reading, after: Reading, settled: bool) -> Counts:
        counters = {k: v - before.counters.get(k, 0) for k, v in after.counters.items()}
        hist = {}
        for k, (total, count) in after.histograms.items():
            t0, c0 = before.histograms.get(k, (0.0, 0))
            hist[k] = (total - t0, count - c0)
        return cls(counters, hist, settled)

    def value(self, name: str, **pairs: str) -> int:
        """Sum of the ``name`` series whose labels include ``pairs``."""
        return sum(
            n
            for (series, labels), n in self.counters.items()
            if series == name and pairs.items() <= dict(labels).items()
        )

    def evicted_without_copy(self) -> int | None:
        """Chunks evicted from host memory with no lower-tier copy (None: this kvoffload
        does not define the counter)."""
        if EVICTED_WITHOUT_COPY not in BY_NAME:
            return None
        return self.value(EVICTED_WITHOUT_COPY, tier="host")

    def transfer(self, direction: str, tier: str) -> tuple[int, float, float]:
        """(chunks, bytes, job seconds) moved ``direction`` on ``tier``."""
        series = (("direction", direction), ("tier", tier))
        nbytes = self.histograms.get(("transfer_bytes", series), (0.0, 0))[0]
        seconds = self.histograms.get(("transfer_seconds", series), (0.0, 0))[0]
        chunks = self.value("transferred_chunks_total", direction=direction, tier=tier)
        return chunks, nbytes, seconds

    def rate(self, direction: str, tier: str) -> tuple[float, float] | None:
        """(chunks/s, GB/s) of the jobs, None when nothing moved."""
        chunks, nbytes, seconds = self.transfer(direction, tier)
        if not chunks or seconds <= 0:
            return None
        return chunks / seconds, nbytes / GB / seconds


def run_counted(spec: Any, batches: Sequence[Sequence[Any]]) -> tuple[RunResult, Counts | None]:
    """A fresh engine for ``spec``: warm-up, the batches, and what kvoffload counted
    during them (None without kvoffload's connector)."""
    with open_engine(spec) as llm:
        warm_up(llm)
        settle(llm)
        before = read(llm)
        result = run_batches(llm, batches)
        ok = settle(llm)
        after = read(llm)
    if before is None or after is None:
        return result, None
    return result, Counts.between(before, after, ok)
