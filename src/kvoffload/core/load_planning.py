"""What a lookup waits for, and the load job of an admitted hit.

Pure functions over the scheduler half's state (they mutate only what their
docstrings name), kept apart from the request lifecycle in
:mod:`kvoffload.core.scheduler`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvoffload.core.anomalies import Anomaly, AnomalyLog
from kvoffload.core.chunk_state import ChunkState
from kvoffload.core.directory import Directory
from kvoffload.core.jobs import JobKind, TransferJob
from kvoffload.core.keys import ChunkKey
from kvoffload.core.request_state import RequestState
from kvoffload.core.scheduler_types import Deferral, SchedulerConfig
from kvoffload.core.store_planning import check_blocks
from kvoffload.core.tier_planning import UNKNOWN, TierPlanner


def next_chunks_wait(
    state: RequestState,
    keys: list[ChunkKey],
    readable: int,
    local: int,
    *,
    directory: Directory,
    tiers: TierPlanner,
    chunk_tokens: int,
) -> tuple[Deferral | None, bool]:
    """Whether the chunks after the readable prefix are worth waiting for: a host
    store of the next one is in flight, or a lower tier holds the next ones (their
    promotion is then wished in ``state.promotion``, for the next plan). Returns the
    reason to wait (None: do not) and whether the promotion wish is new."""
    if state.no_promotion:
        return None, False
    if directory.state_of(keys[readable]) is ChunkState.STORING:
        return Deferral.PENDING, False
    if not tiers:
        return None, False
    found = tiers.find_below(keys[readable:], allowed=state.controls.may_promote_from)
    if found == UNKNOWN:
        return Deferral.LOOKUP, False
    if not isinstance(found, tuple):
        return None, False
    tier, run = found
    if (readable + run) * chunk_tokens - local < chunk_tokens:
        return None, False  # less than a chunk past the engine's own hit
    new = state.promotion is None
    state.promotion = (tier.name, tuple(keys[readable : readable + run]))
    return Deferral.PROMOTION, new


def plan_load_job(
    state: RequestState,
    local: int,
    external: int,
    *,
    offered: int,
    block_ids: Sequence[int],
    config: SchedulerConfig,
    directory: Directory,
    new_id: Callable[[], int],
    anomalies: AnomalyLog,
) -> TransferJob:
    """The load of ``external`` tokens past ``local`` into the request's blocks, its
    chunks pinned in ``directory``; a load of only invalid blocks (the engine
    recomputes them; counted as an anomaly, ``state.load_failed`` set) when the engine
    asked for another hit than ``offered`` or the blocks name the null block or a
    block twice."""
    chunk, block_size = config.chunk_tokens, config.block_size
    first_block = local // block_size
    blocks = tuple(block_ids[first_block : first_block - (-external // block_size)])
    problem: tuple[Anomaly, str] | None
    if external != offered:
        problem = (Anomaly.EXTERNAL_TOKENS, f"{external} external tokens, {offered} offered")
    else:
        problem = check_blocks(blocks, config.null_block)
    if problem is not None:
        kind, detail = problem
        anomalies.note(kind, f"load for request {state.request_id!r}: {detail}; recomputed")
        state.load_failed = True
        return TransferJob(
            job_id=new_id(),
            kind=JobKind.LOAD,
            request_id=state.request_id,
            keys=(),
            slots=(),
            block_ids=(),
            blocks_per_chunk=config.blocks_per_chunk,
            invalid_blocks=blocks,
        )
    keys = state.keys.keys[local // chunk : (local + external) // chunk]
    return TransferJob(
        job_id=new_id(),
        kind=JobKind.LOAD,
        request_id=state.request_id,
        keys=tuple(keys),
        slots=directory.prepare_load(keys),
        block_ids=blocks,
        blocks_per_chunk=config.blocks_per_chunk,
        skip_blocks=(local % chunk) // block_size,
    )
