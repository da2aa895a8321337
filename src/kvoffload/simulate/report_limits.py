"""What a report says about a run's limits and whether its engine kept up: the
engine + kvoffload hit rate against the offline optimum and the infinite cache
(:mod:`kvoffload.simulate.optimum`), and the warning for an engine that fell behind
its trace; :class:`~kvoffload.simulate.report.SimResult` passes its numbers.
"""

from __future__ import annotations

from kvoffload.simulate.optimum import Bounds

# The engine "falls behind the trace" when the median time to first token of the
# last tenth of the requests (by arrival) exceeds this many seconds and this share
# of the trace's span: a queue that keeps growing over the run, so the engine sees
# arrivals compressed and the results describe an overloaded engine.
BEHIND_MIN_S = 30.0
BEHIND_SHARE_OF_SPAN = 0.1


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def is_behind(late_ttft_p50_s: float, trace_span_s: float) -> bool:
    """Whether a run fell behind its trace: the median time to first token of the last
    tenth of its requests, against the trace's span (see ``BEHIND_MIN_S``)."""
    return late_ttft_p50_s > max(BEHIND_MIN_S, BEHIND_SHARE_OF_SPAN * trace_span_s)


def behind_warning(late_ttft_p50_s: float, trace_span_s: float) -> str | None:
    """The warning line for a run whose engine fell behind its trace (None: it kept up)."""
    if not is_behind(late_ttft_p50_s, trace_span_s):
        return None
    return (
        f"WARNING: the simulated engine fell behind the trace: the last tenth of the "
        f"requests waited {late_ttft_p50_s:.0f} s (median) for a first token over a "
        f"{trace_span_s:.0f} s trace, so arrivals pile up and hit rates and TTFTs "
        "describe an overloaded engine; slow the trace (--time-scale) or speed the "
        "engine (--prefill-s-per-token, --token-budget)"
    )


def limit_lines(served: int, prompt_tokens: int, b: Bounds | None) -> list[str]:
    """``served`` prompt tokens (engine + kvoffload) of ``prompt_tokens`` against the
    workload's limits ``b`` (None: not computed)."""
    rate = served / prompt_tokens if prompt_tokens else 0.0
    lines = [
        f"  hit rate (engine + kvo)   {_pct(rate)}  ({served} prompt tokens served / prompt tokens)"
    ]
    if b is not None:
        share = served / b.optimum_tokens if b.optimum_tokens else None
        lines.append(
            f"  limit                     optimum {_pct(b.optimum_rate)} at "
            f"{b.capacity_chunks} chunks, infinite cache {_pct(b.infinite_rate)}; this run "
            + (f"reaches {_pct(share)} of the optimum" if share is not None else "(no hits)")
        )
        if share is not None and share > 1:
            lines.append(
                "                            (above it: the engine's own prefix cache adds "
                "capacity and hits partial chunks, block by block; the limits count "
                "kvoffload's chunks only)"
            )
    return lines
