"""Each tier's learned load cost and hit weight, for KV-aware routers.

Routers weigh an engine's cached tiers with fixed guesses (Dynamo: host memory 0.75,
disk 0.25; llm-d: cpu 0.8, shared storage 0.4). The cost model learns what they are
on this engine; :func:`tier_costs` reads them, per tier (a tier is its lane: ``host``
for host memory -> engine, a lower tier's name for its reads):

- ``load_s_per_chunk``: the time to load one chunk from the tier into the engine, its
  lane's latency plus one chunk's transfer (:meth:`LaneModel.fit`; a worker's time:
  the workers move their shares of a chunk in parallel). With ``through_host``
  (``lower_tier_loads: promote``: a lower tier's hit is promoted into host memory,
  then loaded from there) a lower tier's is its lane's plus host memory's, and absent
  until both lanes are measured.
- ``hit_weight``: the fraction of prefill time a token hit in the tier saves against
  recomputing it, ``1 - load seconds per token / prefill seconds per token`` clamped
  to [0, 1] (:func:`hit_weight`), with the cost model's prefill speed (measured from
  step timings; the ``prefill_tokens_per_s`` seed until then). A chunk of tokens is
  one chunk per KV cache group (``groups``) behind one latency.

Both count one chunk's load with its whole latency: a longer hit spreads the latency
over more chunks and saves more, so the weight is the one-chunk hit's and errs low (a
window group's chunks, needed only for the window on a long hit, err the same way).
A tier whose lane is unmeasured has no entry (its gauges are absent, as the lanes'
own are). Pure: reads the cost model, mutates nothing, never raises.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvoffload.core.cost.model import HOST, CostModel


@dataclass(frozen=True)
class TierCost:
    """One measured tier's figures (see the module docstring): ``load_s_per_chunk`` >=
    0 and ``hit_weight`` in [0, 1], both finite."""

    tier: str
    load_s_per_chunk: float
    hit_weight: float


def hit_weight(load_s: float, tokens: int, tokens_per_s: float) -> float:
    """The fraction of ``tokens`` tokens' prefill time (at ``tokens_per_s``) that
    loading them in ``load_s`` seconds saves, clamped to [0, 1]; 0 when that is not a
    number (no token, no prefill speed, a load that never ends)."""
    if tokens < 1 or not tokens_per_s > 0:
        return 0.0
    saved = 1.0 - load_s * tokens_per_s / tokens
    if not math.isfinite(saved):
        return 0.0
    return min(1.0, max(0.0, saved))


def tier_costs(
    cost: CostModel, *, chunk_tokens: int, groups: int = 1, through_host: bool = False
) -> list[TierCost]:
    """The measured tiers' figures, sorted by tier name (module docstring):
    ``chunk_tokens`` tokens per chunk, ``groups`` KV cache groups (one chunk each per
    chunk of tokens), ``through_host``: lower tiers' hits are promoted, then loaded
    from host memory."""
    rate = cost.prefill.tokens_per_s()
    host = cost.lanes[HOST].fit() if HOST in cost.lanes else None
    out = []
    for name, lane in sorted(cost.lanes.items()):
        fitted = lane.fit()
        if fitted is None:
            continue
        legs = [fitted]
        if through_host and name != HOST:
            if host is None:
                continue
            legs.append(host)
        per_chunk = sum(latency + s_per_chunk for latency, s_per_chunk in legs)
        tokens_chunk = sum(latency + max(1, groups) * s_per_chunk for latency, s_per_chunk in legs)
        out.append(TierCost(name, per_chunk, hit_weight(tokens_chunk, chunk_tokens, rate)))
    return out
