"""What lookup finds past the host-readable prefix: a host store of the next chunk in
flight (wait), a lower tier that cannot tell yet (wait), or a lower tier's run (a tier
hit to offer now, or, with ``direct_tier_loads`` off, a promotion to wish and wait
for), each lower tier's run first passed through the load-or-recompute decision the
caller gives (decision 0013): taken whole, cut to its first chunk (a declined lane's
probe, which re-measures it), or recomputed. Pure over the state given; mutates only
``state.promotion``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import NamedTuple

from kvoffload.core.chunk_state import ChunkState
from kvoffload.core.cost import PROBE_CHUNKS
from kvoffload.core.directory import HostDirectory
from kvoffload.core.keys import ChunkKey
from kvoffload.core.scheduler.group_chunks import wanted_entries
from kvoffload.core.scheduler.request_state import PromotionWish, RequestState
from kvoffload.core.scheduler_types import Deferral, SchedulerConfig
from kvoffload.core.tiering.planning import UNKNOWN, Found, Lookup, TierPlanner


class Take(enum.Enum):
    """The load-or-recompute decision on a lower tier's part of a hit."""

    ALL = "all"  # load it
    PROBE = "probe"  # load its first PROBE_CHUNKS chunk as its lane's probe; recompute the rest
    NONE = "none"  # recompute it


class TierHit(NamedTuple):
    """:func:`next_chunks_wait`: offer a hit of ``chunks`` chunks now, those past the
    host prefix read from lower tier ``tier`` (a tier load)."""

    tier: str
    chunks: int


def next_chunks_wait(
    state: RequestState,
    keys: list[ChunkKey],
    readable: int,
    local: int,
    *,
    directory: HostDirectory,
    tiers: TierPlanner,
    config: SchedulerConfig,
    take: Callable[[str, int, int], Take] = lambda tier, chunks, tokens: Take.ALL,
    waits: Callable[[str], bool] | None = None,
) -> tuple[Deferral | TierHit | None, bool]:
    """Whether the chunks after the readable prefix (``readable`` chunks of ``keys``)
    are worth waiting for: a host store of the next one is in flight, a lower tier
    cannot tell yet, or (``direct_tier_loads`` off) a lower tier holds the next ones
    (their promotion is then wished in ``state.promotion``, for the next plan); with
    ``direct_tier_loads`` a lower tier's run is a :class:`TierHit` to offer now.
    A lower tier's run is neither offered nor promoted unless ``take(tier, chunks,
    tokens)`` (the load-or-recompute decision) takes it, whole or, as its lane's probe,
    cut to the hit the request's first :data:`PROBE_CHUNKS` chunks past the host prefix
    make (as if its keys ended there); a lower tier that cannot tell yet is waited for
    only if ``waits(tier)`` (default: always).
    Returns the reason to wait or the tier hit (None: neither) and whether the
    promotion wish is new."""
    if state.no_promotion:
        return None, False
    chunk, groups = config.chunk_tokens, config.kv_groups
    if any(
        directory.state_of(groups.key(keys[readable], g)) is ChunkState.STORING
        for g in range(len(groups))
    ):
        return Deferral.PENDING, False
    if not tiers:
        return None, False
    found = _run_below(
        state, keys, readable, directory=directory, tiers=tiers, config=config, waits=waits
    )
    if found is UNKNOWN:
        return Deferral.LOOKUP, False
    if not isinstance(found, tuple):
        return None, False
    tier, hit, wanted, wanted_groups = found
    if hit * chunk - local < chunk:
        return None, False  # less than a chunk past the engine's own hit
    taken = take(tier, len(wanted), hit * chunk - max(local, readable * chunk))
    if taken is Take.NONE:
        return None, False  # recomputing the tier's part is faster: never wait for it
    if taken is Take.PROBE:
        cut = keys[: readable + PROBE_CHUNKS]
        found = _run_below(
            state, cut, readable, directory=directory, tiers=tiers, config=config, waits=waits
        )
        if not isinstance(found, tuple) or found[0] != tier:
            return None, False  # the offer lapses (counted nowhere: nothing loaded)
        tier, hit, wanted, wanted_groups = found
        if hit * chunk - local < chunk:
            return None, False
    if config.direct_tier_loads:
        return TierHit(tier, hit), False
    new = state.promotion is None
    state.promotion = PromotionWish(tier, tuple(wanted), wanted_groups)
    return Deferral.PROMOTION, new


def _run_below(
    state: RequestState,
    keys: list[ChunkKey],
    readable: int,
    *,
    directory: HostDirectory,
    tiers: TierPlanner,
    config: SchedulerConfig,
    waits: Callable[[str], bool] | None,
) -> tuple[str, int, list[ChunkKey], tuple[int, ...]] | Lookup | None:
    """(tier, the hit in chunks a promotion from it makes, the keys to promote, their
    KV cache groups), or :data:`UNKNOWN` / None. One group: the run of chain keys the
    first tier holds (no groups). Several: the entries a hit needs beyond host memory,
    the hit shrunk to the first entry no tier in front holds (a few rounds at most)."""
    allowed = state.controls.may_promote_from
    chunk, groups = config.chunk_tokens, config.kv_groups
    if groups.plain:
        found = tiers.find_below(keys[readable:], allowed=allowed, waits=waits)
        if not isinstance(found, Found):
            return found if found is UNKNOWN else None
        return found.tier.name, readable + found.run, keys[readable : readable + found.run], ()
    hit = len(keys)
    for _ in range(4):
        wanted = wanted_entries(directory, groups, keys, readable=readable, hit=hit, chunk=chunk)
        if not wanted:
            return None
        found = tiers.find_below([e.key for e in wanted], allowed=allowed, waits=waits)
        if not isinstance(found, Found):
            return found if found is UNKNOWN else None
        if found.run == len(wanted):
            groups_of = () if groups.single else tuple(e.group for e in wanted)
            return found.tier.name, hit, [e.key for e in wanted], groups_of
        hit = wanted[found.run].chunk
        if hit <= readable:
            return None
    return None
