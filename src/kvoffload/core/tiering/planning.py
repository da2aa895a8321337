"""Spill and promotion jobs between host memory and the lower tiers.

Owned by the scheduler half, which calls it from ``lookup`` (where are the next
chunks?), ``build_plan`` (the jobs) and ``on_report`` (their completions). It books
host slots in the host directory and tier room in each :class:`LowerTier`:

- a spill pins its host chunks (``prepare_load``) until it is reported, so they are
  neither evicted nor overwritten while a worker reads them;
- a promotion reserves host slots (``prepare_store``, bypassing admission: the chunk
  was already admitted once) that become READY for the chunks that arrived and are
  freed for the others.

KV cache groups (``grouped``: a layout of several): a chunk's group is owned by the
host directory's slot table (recorded when its host store or promotion is prepared);
every spill and promotion reads it from there into :attr:`TierJob.groups`, so the
worker writes it into the tier's headers and checks it when reading back (another
group is an integrity miss, reason ``group``). A promotion's groups come from the
planner's entries (:func:`~kvoffload.core.scheduler.group_chunks.wanted_entries`),
passed to :meth:`TierPlanner.plan_promotion`. Lower tiers' own directories keep no
group (the headers below host memory do). One group: jobs carry none.

Spill admission: ``spill_after_hits`` 0 spills every chunk once its host store
completes (write-through); N >= 1 spills a chunk once it has been loaded from host
memory N times (counted in a bounded map).

Nothing queued is lost (decision 0009): a chunk queued for a tier's spill holds one
host pin for that tier (taken when it is queued, carried by its spill job, dropped
when the job is reported), so host eviction, which takes only unpinned chunks, never
takes a chunk still waiting to be copied down. A tier with no room now keeps its
queue for the next plan; meanwhile host stores that find no unpinned chunk to evict
are refused (``no_room_total``): stores are throttled, never copies lost. A failed
spill drops its pin (the tier is failing; the chunk stays readable in host memory
and may be evicted). A discarded chunk leaves the queue at the next plan (its pin
frees its slot). Each host eviction of a chunk no lower tier holds is counted
(``evicted_without_copy_total``, host labels).

Tier loads (a load whose trailing or scattered chunks come straight from a lower
tier, see :class:`~kvoffload.core.jobs.EngineJob`): :meth:`TierPlanner.book_tier_load`
checks and books the tier's chunks (a slotted tier pins them), and
:meth:`TierPlanner.complete_tier_load` releases them, forgetting the copies the
worker found missing or corrupt.

Counts, in each tier's ``metrics``: lookups and hit tokens (chunks found times
``chunk_tokens``), promoted and failed chunks, integrity errors by reason (the part
of the failure's text after ``integrity:``), missing chunks, jobs past their I/O
deadline (``tier_io_timeouts_total``; a timed-out chunk is not forgotten: its copy
is not known bad).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvoffload.core.directory import HostDirectory
from kvoffload.core.directory.admission import MAX_ADMISSION_COUNTERS
from kvoffload.core.errors import ContractViolation, DirectoryUnavailable
from kvoffload.core.failures import ChunkFailure, FailureKind, error_failure
from kvoffload.core.jobs import EngineJob, JobKind, JobResult, TierJob
from kvoffload.core.keys import ChunkKey
from kvoffload.core.tiering.lower import DirectoryTier, LowerTier


@dataclass(frozen=True)
class Found:
    """:meth:`TierPlanner.find_below`: ``tier`` holds the first ``run`` (>= 1) keys."""

    tier: LowerTier
    run: int


class Lookup(enum.Enum):
    """:meth:`TierPlanner.find_below` without a tier to promote from."""

    UNKNOWN = "unknown"  # a tier in front cannot tell yet: ask again later
    ABSENT = "absent"  # no tier asked holds the first key


UNKNOWN = Lookup.UNKNOWN
ABSENT = Lookup.ABSENT


class TierPlanner:
    def __init__(
        self,
        host: HostDirectory,
        tiers: Sequence[LowerTier],
        *,
        chunk_tokens: int,
        spill_after_hits: int = 0,
        max_counters: int = MAX_ADMISSION_COUNTERS,
        grouped: bool = False,
    ) -> None:
        self.host = host
        self.grouped = grouped  # several KV cache groups: tier jobs carry each chunk's group
        self.tiers = {tier.name: tier for tier in tiers}
        self.chunk_tokens = chunk_tokens
        self.spill_after_hits = spill_after_hits
        self._max_counters = max_counters
        self._queues: dict[str, dict[ChunkKey, None]] = {name: {} for name in self.tiers}
        self._hits: OrderedDict[ChunkKey, int] = OrderedDict()
        if self.tiers:
            host.metrics.declare("evicted_without_copy_total")
            host.on_evict = self._note_evicted

    def __bool__(self) -> bool:
        return bool(self.tiers)

    def tier(self, name: str) -> LowerTier | None:
        """The lower tier ``name`` (None: none of that name)."""
        return self.tiers.get(name)

    def replace(self, tier: LowerTier) -> None:
        """Hold ``tier`` in place of the tier of its name (same place in the order),
        counting into the recorder the old one counted into. Only before the first
        plan (no job of the old tier in flight). KeyError when there is none."""
        old = self.tiers[tier.name]
        tier.metrics.rebind(old.metrics.recorder)
        self.tiers[tier.name] = tier

    # ------------------------------------------------------------ lookups

    def find_below(
        self,
        keys: Sequence[ChunkKey],
        allowed: Callable[[str], bool] | None = None,
        waits: Callable[[str], bool] | None = None,
    ) -> Found | Lookup:
        """The first tier holding ``keys[0]`` and how many leading keys it holds
        (:class:`Found`); :data:`UNKNOWN` when a tier in front cannot tell yet and
        ``waits`` accepts waiting for its answer (default: always), while a tier whose
        answer is not waited for is passed over; :data:`ABSENT` when none holds it. Only
        tiers whose name ``allowed`` accepts are asked (default: all)."""
        for tier in self.tiers.values():
            if allowed is not None and not allowed(tier.name):
                continue
            run = tier.present_run(keys)
            tier.metrics.count("lookups_total")
            if run is None:
                if waits is not None and not waits(tier.name):
                    continue
                return UNKNOWN
            if run:
                tier.metrics.count("hit_tokens_total", run * self.chunk_tokens)
                return Found(tier, run)
        return ABSENT

    # ------------------------------------------------------------ admission

    def note_stored(self, keys: Sequence[ChunkKey]) -> None:
        """Host stores of ``keys`` completed."""
        if self.spill_after_hits == 0:
            self._queue(keys)

    def note_loaded(self, keys: Sequence[ChunkKey]) -> None:
        """``keys`` were loaded from host memory (one hit each)."""
        if self.spill_after_hits == 0:
            return
        ripe = []
        for key in keys:
            count = self._hits.pop(key, 0) + 1
            if count >= self.spill_after_hits:
                ripe.append(key)
            else:
                self._hits[key] = count
        while len(self._hits) > self._max_counters:
            self._hits.popitem(last=False)
        self._queue(ripe)

    def _queue(self, keys: Sequence[ChunkKey]) -> None:
        """Queue the readable ``keys`` for every tier, one host pin per tier queue
        (pinned in one call, or key by key when one of them is no longer readable;
        a key the host directory does not pin is not queued)."""
        unique = list(dict.fromkeys(keys))
        for queue in self._queues.values():
            new = [k for k in unique if k not in queue]
            if not new:
                continue
            if self.host.try_prepare_load(new) is not None:
                queue.update(dict.fromkeys(new))
                continue
            for key in new:
                if self.host.try_prepare_load((key,)) is not None:
                    queue[key] = None

    def has_queued(self) -> bool:
        return any(self._queues.values())

    def queued_pins(self) -> int:
        """Host pins the spill queues hold (one per queued key and tier)."""
        return sum(len(queue) for queue in self._queues.values())

    def _note_evicted(self, victims: Sequence[ChunkKey]) -> None:
        """Host evicted ``victims``: count those no lower tier is known to hold."""
        tiers = self.tiers.values()
        lost = sum(1 for key in victims if not any(tier.holds(key) for tier in tiers))
        if lost:
            self.host.metrics.count("evicted_without_copy_total", lost)

    # ------------------------------------------------------------ jobs

    def plan_spills(self, new_id: Callable[[], int]) -> list[TierJob]:
        """Spills of the queued chunks, one per tier with room (they serve no request);
        each job carries its chunks' queue pins. A tier without room keeps its queue
        for the next plan; chunks discarded meanwhile, or the tier holds already,
        leave the queue and drop their pin."""
        jobs = []
        host = self.host
        for name, queue in self._queues.items():
            if not queue:
                continue
            present = self._present_slots(list(queue))
            if present is None:
                continue  # the host directory did not answer: the queue waits
            gone = [k for k in queue if k not in present]
            if gone:
                host.complete_load(gone)  # discarded while queued: its pin frees the slot
            queue.clear()
            keys = list(present)
            if not keys:
                continue
            groups = self._groups(present)
            if groups is None:
                queue.update(dict.fromkeys(keys))  # not answered: retry next plan
                continue
            tier = self.tiers[name]
            booking = tier.book_spill(keys)
            if booking is None:
                queue.update(dict.fromkeys(keys))  # no room below yet: retry next plan
                continue
            queue.update(dict.fromkeys(booking.later))  # no room for them yet
            if len(booking.keys) + len(booking.later) != len(keys):
                booked = {*booking.keys, *booking.later}
                host.complete_load([k for k in keys if k not in booked])  # held already
            if not booking.keys:
                continue
            jobs.append(
                TierJob(
                    job_id=new_id(),
                    kind=JobKind.SPILL,
                    keys=booking.keys,
                    slots=tuple(present[k] for k in booking.keys),  # the queue's pins
                    tier=name,
                    tier_slots=booking.slots,
                    groups=tuple(groups[k] for k in booking.keys) if groups else (),
                )
            )
        return jobs

    def _present_slots(self, keys: list[ChunkKey]) -> dict[ChunkKey, int] | None:
        """The host slot of each of ``keys`` still present (pinned by a spill queue,
        so only a discard removes one), in order: one call, or key by key when one is
        gone; None when the host directory does not answer."""
        host = self.host
        try:
            return dict(zip(keys, host.slots_of(keys), strict=True))
        except DirectoryUnavailable:
            return None
        except ContractViolation:
            pass  # one of them was discarded
        present = {}
        for key in keys:
            slot = host.slot_of(key)
            if slot is not None:
                present[key] = slot
        return present

    def _groups(self, slots: dict[ChunkKey, int]) -> dict[ChunkKey, int] | None:
        """Each chunk's KV cache group (grouped layouts; ``{}`` otherwise), or None
        when the host directory does not answer."""
        if not self.grouped or not slots:
            return {}
        try:
            groups = self.host.groups_of(tuple(slots.values()))
        except DirectoryUnavailable:
            return None
        return dict(zip(slots, groups, strict=True))

    def plan_promotion(
        self,
        request_id: str,
        tier_name: str,
        keys: Sequence[ChunkKey],
        new_id: Callable[[], int],
        groups: Sequence[int] = (),
    ) -> TierJob | None:
        """A promotion (for ``request_id``) of the ``keys`` missing from host memory,
        of KV cache groups ``groups`` (one per key; empty: all 0), or None (no room,
        or nothing left to promote)."""
        tier = self.tiers[tier_name]
        if tier.present_run(keys) != len(keys):
            return None  # changed since the lookup
        host = self.host
        prepared = host.prepare_store(keys, admit_all=True, groups=groups or None)
        if prepared.no_room or not prepared.keys:
            return None
        booked = self._groups(dict(zip(prepared.keys, prepared.slots, strict=True)))
        tier_slots = tier.book_promotion(prepared.keys) if booked is not None else None
        if booked is None or tier_slots is None:
            host.complete_store(prepared.keys, success=False)  # not answered, or gone below
            return None
        return TierJob(
            job_id=new_id(),
            kind=JobKind.PROMOTE,
            keys=prepared.keys,
            slots=prepared.slots,
            tier=tier_name,
            tier_slots=tier_slots,
            request_id=request_id,
            groups=tuple(booked.values()) if booked else (),
        )

    def book_tier_load(self, tier_name: str, keys: Sequence[ChunkKey]) -> tuple[int, ...] | None:
        """Book ``keys`` of tier ``tier_name`` for a tier load (kept until
        :meth:`complete_tier_load`): their tier slots (slotted tier) or ``()``; None,
        booking nothing, when the tier is known to lack one of them (a tier that cannot
        tell now is booked: a chunk gone by read time fails the load, a miss), or when
        the tier could not book them (a shared tier lost one, or did not answer)."""
        tier = self.tiers.get(tier_name)
        if tier is None:
            return None
        run = tier.present_run(keys)
        if run is not None and run != len(keys):
            return None
        return tier.book_promotion(keys)

    def complete_tier_load(self, job: EngineJob, result: JobResult) -> None:
        """A tier load every worker reported: release its tier chunks, forget those
        found missing or corrupt, count the outcome under the tier's labels."""
        if job.tier is None:
            return
        tier = self.tiers[job.tier]
        mine = job.tier_chunks()
        from_tier = set(mine)
        failed = {i: f for i, f in result.failed_chunks if i in from_tier}
        if not result.success and not failed:
            cause = error_failure(str(result.error) or "failed")
            failed = dict.fromkeys(mine, cause)
        keys = [job.keys[i] for i in mine]
        gone = [job.keys[i] for i, failure in failed.items() if failure.copy_gone]
        tier.release_promotion(keys, gone)
        tier.metrics.count("transferred_chunks_total", len(mine) - len(failed), direction="load")
        tier.metrics.count("failed_chunks_total", len(failed), direction="load")
        self._count_failures(tier, failed.values())
        self.count_timeouts(job.tier, "load", result)

    def count_timeouts(self, tier_name: str, direction: str, result: JobResult) -> None:
        """Count a job a worker timed out (once per job, whatever its chunks):
        ``tier_io_timeouts_total`` under the tier's labels."""
        if any(failure.timed_out for _, failure in result.failed_chunks):
            self.tiers[tier_name].metrics.count("tier_io_timeouts_total", direction=direction)

    def _count_failures(self, tier: LowerTier, failures: Iterable[ChunkFailure]) -> None:
        for failure in failures:
            if failure.kind is FailureKind.INTEGRITY:
                # the reason: the part of the text "integrity:<reason>" after the colon
                tier.metrics.count("integrity_errors_total", reason=failure.detail)
            elif failure.kind is FailureKind.MISSING:
                tier.metrics.count("missing_chunks_total")

    def complete(self, job: TierJob, result: JobResult) -> None:
        """Book a spill's or a promotion's outcome (aggregated over every worker)."""
        tier = self.tiers[job.tier]
        failed: dict[int, ChunkFailure] = dict(result.failed_chunks)
        if not result.success:
            error = result.error
            cause = error if isinstance(error, ChunkFailure) else error_failure(error or "failed")
            failed = dict.fromkeys(range(len(job.keys)), cause)
        ok = [k for i, k in enumerate(job.keys) if i not in failed]
        bad = [job.keys[i] for i in failed]
        if job.kind is JobKind.SPILL:
            self.host.complete_load(job.keys)
            tier.complete_spill(ok, bad)
            return
        if ok:
            self.host.complete_store(ok, success=True)
        if bad:
            self.host.complete_store(bad, success=False)
        gone = [job.keys[i] for i, failure in failed.items() if failure.copy_gone]
        tier.release_promotion(job.keys, gone)
        tier.metrics.count("transferred_chunks_total", len(ok), direction="promote")
        tier.metrics.count("failed_chunks_total", len(bad), direction="promote")
        self._count_failures(tier, failed.values())

    def reset(self) -> None:
        """A connector reset: every tier forgets what it holds; queued spills and hit
        counts (old keys) are dropped (with their host pins). Jobs in flight complete
        into the reset tiers."""
        for queue in self._queues.values():
            if queue:
                self.host.complete_load(list(queue))
            queue.clear()
        self._hits.clear()
        for tier in self.tiers.values():
            tier.reset()

    def directory_tiers(self) -> list[DirectoryTier]:
        return [t for t in self.tiers.values() if isinstance(t, DirectoryTier)]
