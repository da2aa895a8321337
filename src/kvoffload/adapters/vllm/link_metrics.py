"""A node share's link counters as the scheduler half's metric
``host_share_calls_total{outcome}`` (the host share's calls: connects, calls not
answered in time, connections lost, node process starts...)."""

from __future__ import annotations

from collections.abc import Mapping

from kvoffload.core.observe.recorder import MetricsRecorder

LINK_OUTCOMES = ("connects", "unavailable", "timeouts", "lost", "errors", "server_starts")
"""The link's counters (``share.link.Link.stats``) exported per ``outcome``."""


class LinkCounters:
    """Moves the link's counters (``Link.stats``, counted by the link itself) into the
    scheduler half's recorder as ``host_share_calls_total{outcome}``; owned by the
    scheduler half, called under its lock before each metrics reading."""

    def __init__(self, recorder: MetricsRecorder) -> None:
        self.recorder = recorder
        self.seen: dict[str, int] = dict.fromkeys(LINK_OUTCOMES, 0)
        for outcome in LINK_OUTCOMES:
            recorder.declare("host_share_calls_total", outcome=outcome)

    def sync(self, stats: Mapping[str, int]) -> None:
        """Count what the link counted since the last call."""
        for outcome in LINK_OUTCOMES:
            now = stats.get(outcome, 0)
            if now > self.seen[outcome]:
                self.recorder.count(
                    "host_share_calls_total", now - self.seen[outcome], outcome=outcome
                )
                self.seen[outcome] = now
