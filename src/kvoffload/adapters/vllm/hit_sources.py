"""Which of vLLM's cache-hit sources each kvoffload tier is, for the per-tier split
of a hit vLLM asks for (``get_external_cache_hit_sources``; its prefix-cache stats
count hit tokens per source).

A tier is vLLM's ``host`` source when its medium is host memory, ``disk`` when it is
local storage, and ``external_unspecified`` when it is remote (a Redis/Valkey
server: vLLM's own connector reports its remote stores so too). Read from each
tier's spec (``medium``, ``locality``), so a new tier needs no line here. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvoffload.adapters.vllm.compat import CacheHitSource
from kvoffload.tiers.registry import TIERS
from kvoffload.tiers.spec import Locality


def _source_of(medium: str, locality: Locality) -> CacheHitSource:
    if locality is Locality.REMOTE:
        return CacheHitSource.EXTERNAL_UNSPECIFIED
    if medium == "CPU":
        return CacheHitSource.HOST
    return CacheHitSource.DISK


SOURCES: dict[str, CacheHitSource] = {
    spec.name: _source_of(spec.medium, spec.locality) for spec in TIERS
}
"""Each tier's source, by tier name."""


def hit_sources(by_tier: Mapping[str, int]) -> dict[CacheHitSource, int]:
    """Token counts by tier name as vLLM's sources (a name no tier has counts as
    ``external_unspecified``); only non-zero counts, same total."""
    out: dict[CacheHitSource, int] = {}
    for name, tokens in by_tier.items():
        if tokens > 0:
            source = SOURCES.get(name, CacheHitSource.EXTERNAL_UNSPECIFIED)
            out[source] = out.get(source, 0) + tokens
    return out
