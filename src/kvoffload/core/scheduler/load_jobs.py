"""The load job of an admitted hit: which blocks it fills, where each chunk is read
from (host slots pinned, a lower tier's booked), or a load of only invalid blocks when
the engine's allocation or the tiers no longer match what lookup offered (decision
0009). Pure over the state it is given: mutates only ``state.load_failed``, the
directory's and tier's pins and bookings, and the anomaly log it is handed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvoffload.core.directory import HostDirectory, LookupStatus
from kvoffload.core.jobs import NO_BLOCK, NO_SLOT, EngineJob, JobKind
from kvoffload.core.keys import ChunkKey
from kvoffload.core.observe.anomalies import Anomaly, AnomalyLog
from kvoffload.core.scheduler.block_tables import GroupBlocks
from kvoffload.core.scheduler.group_chunks import Entry, load_entries
from kvoffload.core.scheduler.request_state import RequestState
from kvoffload.core.scheduler.stores import check_blocks
from kvoffload.core.scheduler_types import SchedulerConfig
from kvoffload.core.tiering.planning import TierPlanner


def plan_load_job(
    state: RequestState,
    local: int,
    external: int,
    *,
    offered: int,
    blocks: GroupBlocks,
    config: SchedulerConfig,
    directory: HostDirectory,
    tiers: TierPlanner,
    new_id: Callable[[], int],
    anomalies: AnomalyLog,
) -> EngineJob:
    """The load of ``external`` tokens past ``local`` into the request's blocks: its
    host chunks pinned in ``directory``, the others (a tier load, when the lookup
    offered a hit in lower tier ``state.lookup_tier``) booked in that tier. A load of
    only invalid blocks (the engine recomputes them; counted as an anomaly,
    ``state.load_failed`` set) when the engine asked for another hit than ``offered``,
    the blocks name the null block or a block twice, or a chunk is in neither host
    memory nor the lower tier any more."""
    chunk, block_size = config.chunk_tokens, config.block_size
    entries: list[Entry] = []
    if config.kv_groups.plain:
        first_block = local // block_size
        moved = tuple(blocks[0][first_block : first_block - (-external // block_size)])
    else:
        entries = load_entries(state.blocks, state.keys.keys, local, local + external, config)
        moved = tuple(b for e in entries for b in e.blocks if b != NO_BLOCK)
    problem: tuple[Anomaly, str] | None
    if external != offered:
        problem = (Anomaly.EXTERNAL_TOKENS, f"{external} external tokens, {offered} offered")
    else:
        problem = check_blocks(moved, config.null_block)
    if entries:  # several groups or a window: NO_BLOCK marks what is not moved
        keys = [e.key for e in entries]
        block_ids, skip = tuple(b for e in entries for b in e.blocks), 0
    else:
        keys = state.keys.keys[local // chunk : (local + external) // chunk]
        block_ids, skip = moved, (local % chunk) // block_size
    sources = None
    if problem is None:
        sources = _sources(keys, entries, state.lookup_tier, directory, tiers)
        if sources is None:
            problem = (Anomaly.CHUNK_GONE, "a chunk left every tier since the lookup")
    if problem is not None or sources is None:
        kind, detail = problem or (Anomaly.EXTERNAL_TOKENS, "")
        anomalies.note(kind, f"load for request {state.request_id!r}: {detail}; recomputed")
        state.load_failed = True
        return EngineJob(
            job_id=new_id(),
            kind=JobKind.LOAD,
            request_id=state.request_id,
            keys=(),
            slots=(),
            block_ids=(),
            blocks_per_chunk=config.blocks_per_chunk,
            invalid_blocks=moved,
        )
    slots, tier, tier_slots, groups = sources
    return EngineJob(
        job_id=new_id(),
        kind=JobKind.LOAD,
        request_id=state.request_id,
        keys=tuple(keys),
        slots=slots,
        block_ids=block_ids,
        blocks_per_chunk=config.blocks_per_chunk,
        skip_blocks=skip,
        tier=tier,
        tier_slots=tier_slots,
        groups=groups,
    )


def _sources(
    keys: Sequence[ChunkKey],
    entries: Sequence[Entry],
    tier: str | None,
    directory: HostDirectory,
    tiers: TierPlanner,
) -> tuple[tuple[int, ...], str | None, tuple[int, ...], tuple[int, ...]] | None:
    """Where each of ``keys`` is read from: (slots, with :data:`NO_SLOT` for the chunks
    read from ``tier``; that tier (None: host memory only); their tier slots; their KV
    cache groups when ``entries`` name several). Pins the host chunks and books the
    tier's; None, changing nothing, when a chunk is in neither. Host chunks are pinned
    with ``try_prepare_load``: a shared host tier may lose a chunk to another engine
    after the lookup, or not answer in time; that is a miss here, never an error."""
    if tier is None:  # a host hit: every chunk readable there, as lookup offered
        if directory.readable_prefix(keys) != len(keys):
            return None
        host = directory.try_prepare_load(keys)
        return None if host is None else (host, None, (), ())
    status = directory.lookup(keys).statuses
    from_tier = [i for i, st in enumerate(status) if st is not LookupStatus.HIT]
    if not from_tier:
        host = directory.try_prepare_load(keys)
        return None if host is None else (host, None, (), ())
    host_keys = [k for k, st in zip(keys, status, strict=True) if st is LookupStatus.HIT]
    pinned = directory.try_prepare_load(host_keys) if host_keys else ()
    if pinned is None:
        return None
    tier_keys = [keys[i] for i in from_tier]
    tier_slots = tiers.book_tier_load(tier, tier_keys)
    if tier_slots is None:
        if host_keys:
            directory.complete_load(host_keys)
        return None
    host_slots = iter(pinned)
    slots = tuple(NO_SLOT if st is not LookupStatus.HIT else next(host_slots) for st in status)
    groups = tuple(entries[i].group for i in from_tier) if tiers.grouped and entries else ()
    return slots, tier, tier_slots, groups


HOST_SOURCE = "host"
"""The source :func:`load_sources` names for chunks read from host memory."""


def load_sources(job: EngineJob, tokens: int) -> dict[str, int]:
    """How many of a load's ``tokens`` each tier supplies: the job's lower tier (its
    :data:`NO_SLOT` chunks) in proportion to its share of the job's chunks (every KV
    cache group's alike), host memory the rest. Only non-zero counts; they sum to
    ``tokens``; empty for a load of only invalid blocks. Chunks a promotion brought
    up before the load are read from host memory and count there. Pure."""
    if tokens <= 0 or not job.keys:
        return {}
    from_tier = sum(1 for slot in job.slots if slot == NO_SLOT)
    if job.tier is None or not from_tier:
        return {HOST_SOURCE: tokens}
    tier_tokens = (tokens * from_tier + len(job.keys) // 2) // len(job.keys)
    sources = {HOST_SOURCE: tokens - tier_tokens, job.tier: tier_tokens}
    return {name: n for name, n in sources.items() if n}
