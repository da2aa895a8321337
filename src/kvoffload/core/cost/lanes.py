"""One lane's transfer time, learned online from its own jobs' timings.

A lane (host memory -> engine, or one lower tier -> engine) makes ``n`` chunks ready in
``latency_s + n * s_per_chunk`` seconds, ``n`` counting the chunks queued on the lane
ahead of a job as well as its own (a job that shares the lane with others takes
longer; counted this way, a lane's time per chunk is its throughput, and the queue the
decision adds is not counted a second time inside the time per chunk).
:class:`LaneModel` fits both from the last :data:`WINDOW` job timings (chunks, seconds),
each older sample weighing :data:`DECAY` times the next one (weighted least squares;
when every sample moved as many chunks the latency stays at its seed, clamped to the
samples' time). Bytes are
kept beside, only to show a bandwidth. With no sample the lane is *unmeasured*: its
estimate is None, which the decision takes as "load" (no loss against always
loading until there is evidence).

Owned and mutated by one :class:`~kvoffload.core.cost.model.CostModel`; never raises.
"""

from __future__ import annotations

import math
from collections import deque

WINDOW = 32
"""Job timings a lane keeps (the oldest is dropped past it)."""

DECAY = 0.9
"""Weight of a sample relative to the next newer one."""


class LaneModel:
    """One lane's latency and time per chunk (see the module docstring)."""

    __slots__ = ("_samples", "bytes_per_chunk", "name", "seed_latency_s")

    def __init__(self, name: str, *, seed_latency_s: float = 0.0) -> None:
        self.name = name
        self.seed_latency_s = seed_latency_s
        self._samples: deque[tuple[int, float]] = deque(maxlen=WINDOW)
        self.bytes_per_chunk = 0.0  # the last sample's, for the bandwidth shown

    def observe(self, chunks: int, nbytes: int, seconds: float, ahead: int = 0) -> None:
        """One job of ``chunks`` chunks (``nbytes``), planned behind ``ahead`` chunks
        queued on the lane, took ``seconds``; nonsense is ignored."""
        if chunks < 1 or ahead < 0 or not math.isfinite(seconds) or seconds < 0:
            return
        self._samples.append((chunks + ahead, seconds))
        if nbytes > 0:
            self.bytes_per_chunk = nbytes / chunks

    def restart(self, chunks: int, nbytes: int, seconds: float, ahead: int = 0) -> None:
        """A probe's timing (:mod:`~kvoffload.core.cost.probing`): the first evidence
        since the lane was declined, so it starts the window again (among the old
        samples it would weigh a tenth, and a tier that turned fast would need some
        twenty probes to be believed). The latency fitted so far becomes the seed (the
        fit clamps it to the probe's time), so a one-chunk probe of a lane bound by its
        latency (a round trip) is not read as a cost per chunk. Nonsense is ignored."""
        if chunks < 1 or ahead < 0 or not math.isfinite(seconds) or seconds < 0:
            return
        fitted = self.fit()
        if fitted is not None:
            self.seed_latency_s = fitted[0]
        self._samples.clear()
        self.observe(chunks, nbytes, seconds, ahead)

    @property
    def samples(self) -> int:
        return len(self._samples)

    def fit(self) -> tuple[float, float] | None:
        """(latency_s, s_per_chunk), or None while unmeasured."""
        if not self._samples:
            return None
        w = sw = sx = sy = sxx = sxy = 0.0
        for chunks, seconds in reversed(self._samples):  # newest first
            w = 1.0 if w == 0.0 else w * DECAY
            sw += w
            sx += w * chunks
            sy += w * seconds
            sxx += w * chunks * chunks
            sxy += w * chunks * seconds
        mx, my = sx / sw, sy / sw
        var = sxx / sw - mx * mx
        if var > 1e-9 * mx * mx:
            slope = max(0.0, (sxy / sw - mx * my) / var)
            latency = max(0.0, my - slope * mx)
            return latency, slope
        latency = min(self.seed_latency_s, my)
        return latency, (my - latency) / mx

    def seconds(self, chunks: int) -> float | None:
        """Expected seconds to move ``chunks`` chunks on an idle lane (None: unmeasured)."""
        fitted = self.fit()
        if fitted is None:
            return None
        latency, per_chunk = fitted
        return latency + chunks * per_chunk

    def bytes_per_second(self) -> float | None:
        fitted = self.fit()
        if fitted is None or fitted[1] <= 0 or self.bytes_per_chunk <= 0:
            return None
        return self.bytes_per_chunk / fitted[1]
