"""The store family: store jobs of newly full chunks, flush fences, completion.

:class:`StorePlanner` owns both ends of a store: it plans the job for the chunks a
request filled since its store cursor (never from the null block or a block named
twice), says which in-flight stores a step must flush (their source blocks are
handed out fresh), and completes them (a success makes the chunks readable and
queues them for the lower tiers; a failure frees their slots). The functions below
it are pure over the state they are given (they mutate only what their docstrings
name).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvoffload.core.directory import HostDirectory
from kvoffload.core.jobs import EngineJob, JobKind
from kvoffload.core.observe.anomalies import Anomaly, AnomalyLog
from kvoffload.core.observe.metrics import labels
from kvoffload.core.scheduler.context import Context
from kvoffload.core.scheduler.group_chunks import StoreSource, store_entries
from kvoffload.core.scheduler.job_tracker import Completion, JobTracker
from kvoffload.core.scheduler.request_state import Phase, RequestState
from kvoffload.core.scheduler_types import SchedulerConfig

_STORED_TO_HOST = ("transferred_chunks_total", labels(direction="store", tier="host"))


class StorePlanner:
    """Store jobs, their fences and their completion (see the module docstring)."""

    def __init__(self, ctx: Context) -> None:
        self.config = ctx.config
        self.directory = ctx.directory
        self.tiers = ctx.tiers
        self.requests = ctx.requests
        self.stats = ctx.stats
        self.metrics = ctx.metrics
        self.anomalies = ctx.anomalies

    def plan(self, state: RequestState) -> EngineJob | None:
        """The request's next store job, tracked, or None (always None while a load
        of the request is in flight)."""
        tracker = self.requests.tracker
        if tracker.has_load(state.request_id):
            return None
        job = plan_store_job(state, self.directory, tracker.new_id, self.config, self.anomalies)
        if job is None:
            return None
        tracker.add(job)
        self.stats.stores += 1
        self.metrics.add(_STORED_TO_HOST, len(job.keys))
        return job

    def flush_set(self, preempted: set[int], fresh_blocks: set[int], planned: set[int]) -> set[int]:
        """The in-flight stores this step's workers must finish first: those of
        preempted requests and those fenced by ``fresh_blocks`` (``planned``: the
        stores this step planned)."""
        tracker = self.requests.tracker
        flush = set(preempted)
        if fresh_blocks and tracker.has_fences():
            mine = planned if self.config.kv_groups.windowed else None
            flush |= fenced_stores(tracker, self.requests.as_dict(), fresh_blocks, mine)
        if flush:
            flush = {i for i in flush if (job := tracker.get(i)) and job.kind is JobKind.STORE}
        if flush:
            self.metrics.count("flushes_total", len(flush))
        return flush

    def complete(self, completion: Completion) -> None:
        job = completion.job
        self.directory.complete_store(job.keys, completion.success)
        if completion.success:
            self.tiers.note_stored(job.keys)
            return
        self.stats.store_failures += 1
        self.metrics.count("failed_chunks_total", len(job.keys), direction="store", tier="host")


def check_blocks(blocks: Sequence[int], null_block: int | None) -> tuple[Anomaly, str] | None:
    """Why ``blocks`` cannot be stored from or loaded into (the engine's null block,
    a block named twice), or None when they can."""
    if null_block is not None and null_block in blocks:
        return Anomaly.NULL_BLOCK, f"blocks {list(blocks)} include the null block {null_block}"
    if len(set(blocks)) != len(blocks):
        return Anomaly.DUPLICATE_BLOCK, f"blocks {list(blocks)} name a block twice"
    return None


def _storable_end(
    state: RequestState,
    source: StoreSource,
    *,
    start: int,
    end: int,
    config: SchedulerConfig,
    anomalies: AnomalyLog,
) -> int:
    """``end``, or the first chunk in ``[start, end)`` whose entries in ``source`` name
    the null block or a block named twice in that range (such a chunk is never stored)."""
    blocks = [b for chunk_blocks in source.blocks for b in chunk_blocks]
    if check_blocks(blocks, config.null_block) is None:
        return end
    seen: set[int] = set()
    for i in range(start, end):
        chunk_blocks = [
            b for c, bs in zip(source.chunks, source.blocks, strict=True) if c == i for b in bs
        ]
        problem = check_blocks(chunk_blocks, config.null_block)
        if problem is None and seen.isdisjoint(chunk_blocks):
            seen.update(chunk_blocks)
            continue
        kind, detail = problem or (Anomaly.DUPLICATE_BLOCK, f"chunk {i} reuses a block")
        anomalies.note(kind, f"request {state.request_id!r} chunk {i}: {detail}; not stored")
        return i
    return end


def plan_store_job(
    state: RequestState,
    directory: HostDirectory,
    new_id: Callable[[], int],
    config: SchedulerConfig,
    anomalies: AnomalyLog,
) -> EngineJob | None:
    """A store job for the request's chunks that became full since its store cursor.

    Full means: every token of the chunk has a block hash (tokens known) and KV
    (``computed_tokens``), and the request holds the chunk's blocks. Prepares the
    store in ``directory`` (with several KV cache groups, each chunk's group kept with
    its slot) and advances ``state.stored_chunks``. When not all fit, the leading
    chunks that fit are stored; when none fits, nothing changes (the chunks
    are offered again next step) and it returns None. Never for a request whose KV
    predates a connector reset (nor, by its caller, for one with a load in flight:
    :meth:`StorePlanner.plan`). A chunk naming the
    engine's null block or a block named twice is never stored (counted as an
    anomaly): the chunks before it are, then the cursor skips it."""
    if state.stale_kv:
        return None
    k, chunk = config.blocks_per_chunk, config.chunk_tokens
    hashes = state.request.block_hashes
    keys = state.keys.extend(hashes)
    tokens = min(state.computed_tokens, len(hashes) * config.hash_tokens)
    end = min(tokens // chunk, len(keys), state.blocks.num_blocks() // k)
    cap = state.controls.store_chunks(chunk)
    if cap is not None:
        end = min(end, cap)  # the request's store / max_store_tokens
    start = state.stored_chunks
    if end <= start:
        return None
    source = store_entries(
        state.blocks, keys, start, end, scheduled_from=state.scheduled_from, config=config
    )
    usable = _storable_end(state, source, start=start, end=end, config=config, anomalies=anomalies)
    bad = usable if usable < end else None  # never stored: the cursor skips it
    end = usable
    if end <= start:
        if bad is not None:
            state.stored_chunks = bad + 1
        return None
    if bad is not None:
        source = source.before(end)
    grouped = not config.kv_groups.single  # each chunk's group kept in its host slot
    prepared = directory.prepare_store(source.keys, groups=source.groups if grouped else None)
    room = directory.free_slots + directory.evictable_count
    while prepared.no_room and room > 0:
        # Not everything fits: store the leading chunks that do (a prefix is what a
        # later request can use); the rest is offered again next step.
        cut = min(room, len(source) - 1)
        end = source.chunks[cut] if cut > 0 else start
        source = source.before(end)
        room //= 2
        prepared = directory.prepare_store(source.keys, groups=source.groups if grouped else None)
    if prepared.no_room:
        return None
    state.stored_chunks = end + 1 if end == bad else end
    if not prepared.keys:
        return None
    blocks_of = dict(zip(source.keys, source.blocks, strict=True))
    blocks = tuple(b for key in prepared.keys for b in blocks_of[key])
    return EngineJob(
        job_id=new_id(),
        kind=JobKind.STORE,
        request_id=state.request_id,
        keys=prepared.keys,
        slots=prepared.slots,
        block_ids=blocks,
        blocks_per_chunk=k,
    )


def fenced_stores(
    tracker: JobTracker,
    states: dict[str, RequestState],
    fresh_blocks: set[int],
    planned: set[int] | None = None,
) -> set[int]:
    """In-flight store jobs that must finish before this step writes ``fresh_blocks``.

    A store is fenced when it reads a block handed out fresh this step to anyone but
    the store's own running request: that request's fresh blocks are exactly what
    its stores capture, after this step's forward pass writes them. With window
    groups (``planned`` given: the stores planned this step) a running request can
    be handed again a block its window freed, which an older store of its own still
    reads: only this step's stores are exempt then."""
    fenced: set[int] = set()
    if not fresh_blocks:
        return fenced
    for job_id in tracker.fenced(fresh_blocks):
        job = tracker.get(job_id)
        if not isinstance(job, EngineJob):
            continue  # gone (fences name only stores)
        owner = states.get(job.request_id)
        mine = planned is None or job_id in planned
        if owner is not None and owner.phase is Phase.RUNNING and mine:
            held = owner.blocks.all_blocks()
            if all(b in held for b in job.block_ids if b in fresh_blocks):
                continue
        fenced.add(job_id)
    return fenced
