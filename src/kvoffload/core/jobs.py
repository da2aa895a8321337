"""Transfer jobs and the two value objects the halves exchange each engine step.

The scheduler half sends a :class:`StepPlan` (loads, stores, jobs to flush, and the
lower tiers' spills and promotions) to every
worker; each worker answers with a :class:`WorkerReport` (one :class:`JobResult` per
finished job). All are immutable; job ids are unique for the life of a scheduler
(monotonic, never reused, also across resets).

Two families of job, two types: an :class:`EngineJob` (a load or a store) moves
chunks between host slots and engine blocks for one request; a :class:`TierJob` (a
spill or a promotion) moves chunks between host slots and a lower tier, for a request
(a promotion) or for none (a spill). :data:`TransferJob` names either, for code that
handles both (the job tracker, the harnesses); the kind tells them apart as well as
the type does.

Block addressing: an engine job moves whole chunks between host slots and engine
blocks. Chunk ``i`` of a job lives in host slot ``slots[i]`` and spans
``blocks_per_chunk`` (k) engine blocks. ``block_ids`` lists the engine blocks in chunk
order. A load may start inside its first chunk: ``skip_blocks`` (0 <= skip < k)
leading blocks of chunk 0 are already computed by the engine and are not written, so
block ``block_ids[m]`` receives block ``(m + skip_blocks) % k`` of chunk
``(m + skip_blocks) // k``. Stores always have ``skip_blocks == 0``. A load's
block id may be :data:`NO_BLOCK`: that block of that chunk is not written (a hybrid
model's load skips blocks the engine computed itself or that lie below a sliding
window; such loads use ``skip_blocks == 0``). Stores never name it.

A load may read some of its chunks straight from a lower tier (a *tier load*): their
slot is :data:`NO_SLOT` and they come from ``tier`` (at ``tier_slots``, one per such
chunk, in a slotted tier; their KV cache ``groups``, one per such chunk, or none: all
0), through the worker's bounded staging area, verified before they reach an engine
block; the other chunks come from host slots as usual. Host memory needs no room for
them. :meth:`EngineJob.part` cuts a job into such pieces.

A load may also name ``invalid_blocks``: engine blocks the engine expects this load
to fill that kvoffload cannot supply (an anomaly, or offloading turned off after an
internal error). The worker reports them as failed loads when the job ends, so the
engine recomputes them; such a load may have no chunk at all.

Which media a job's chunks move between (its *legs*: host -> engine, engine -> host,
host -> a tier, a tier -> host, a tier -> engine; none for a load of invalid blocks
only) is said in one place, :func:`kvoffload.core.tiering.routes.legs`; the worker backends
dispatch by leg, not by these fields.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

from kvoffload.core.errors import ContractViolation
from kvoffload.core.failures import ChunkFailure
from kvoffload.core.keys import ChunkKey

NO_BLOCK = -1
"""A load's placeholder block id: this block of the chunk is not moved."""

NO_SLOT = -1
"""A tier load's placeholder host slot: this chunk is read from the job's lower tier."""


ASLEEP = "sleep fence: the engine's KV memory is released (vLLM sleep mode)"
"""The error of an engine load or store a worker refused while the engine's KV
memory is released (``adapters/vllm/sleep_state.py``, decision 0021): nothing was
copied; a load is recomputed, a store is never made readable."""


class JobKind(enum.Enum):
    LOAD = "load"  # host slots -> engine blocks (an EngineJob)
    STORE = "store"  # engine blocks -> host slots (an EngineJob)
    SPILL = "spill"  # host slots -> a lower tier (a TierJob)
    PROMOTE = "promote"  # a lower tier -> host slots (a TierJob)

    __hash__ = object.__hash__  # singletons: by identity (hashed per job, on hot paths)

    @property
    def touches_engine(self) -> bool:
        return self is JobKind.LOAD or self is JobKind.STORE


@dataclass(frozen=True)
class EngineJob:
    """A load or a store of one request's chunks (addressing: the module docstring).

    Raises :class:`ContractViolation` at construction when the kind is a tier kind,
    the slots, blocks and keys do not add up, or it moves nothing."""

    job_id: int
    kind: JobKind
    request_id: str
    keys: tuple[ChunkKey, ...]
    slots: tuple[int, ...]
    block_ids: tuple[int, ...]
    blocks_per_chunk: int
    skip_blocks: int = 0
    invalid_blocks: tuple[int, ...] = ()  # loads: blocks to report invalid (see above)
    tier: str | None = None  # tier loads: where the NO_SLOT chunks come from
    tier_slots: tuple[int, ...] = ()  # one per NO_SLOT chunk (slotted tiers), or none
    groups: tuple[int, ...] = ()  # one KV cache group per NO_SLOT chunk, or none (all 0)

    def __post_init__(self) -> None:
        k = self.blocks_per_chunk
        if not self.kind.touches_engine:
            raise ContractViolation(f"job {self.job_id}: a {self.kind.value} is a tier job")
        if self.tier is not None or NO_SLOT in self.slots:
            self._check_tier_load()
        if k <= 0 or len(self.keys) != len(self.slots):
            raise ContractViolation(f"job {self.job_id}: needs one slot per key and k > 0")
        if self.invalid_blocks and self.kind is not JobKind.LOAD:
            raise ContractViolation(f"job {self.job_id}: only loads name invalid blocks")
        if not self.slots and not self.invalid_blocks:
            raise ContractViolation(f"job {self.job_id}: moves no chunk")
        if not 0 <= self.skip_blocks < k or (self.kind is JobKind.STORE and self.skip_blocks):
            raise ContractViolation(f"job {self.job_id}: skip_blocks {self.skip_blocks} invalid")
        if self.kind is JobKind.STORE and NO_BLOCK in self.block_ids:
            raise ContractViolation(f"job {self.job_id}: a store names no block")
        if len(self.block_ids) != k * len(self.slots) - self.skip_blocks:
            raise ContractViolation(
                f"job {self.job_id}: {len(self.block_ids)} blocks for {len(self.slots)} "
                f"chunks of {k} (skip {self.skip_blocks})"
            )

    def _check_tier_load(self) -> None:
        from_tier = self.slots.count(NO_SLOT)
        if self.kind is not JobKind.LOAD or not self.tier or not from_tier:
            raise ContractViolation(
                f"job {self.job_id}: only a load reads chunks (slot NO_SLOT) from a named tier"
            )
        if self.tier_slots and len(self.tier_slots) != from_tier:
            raise ContractViolation(f"job {self.job_id}: one tier slot per tier chunk, or none")
        if self.groups and len(self.groups) != from_tier:
            raise ContractViolation(f"job {self.job_id}: one group per tier chunk, or none")

    def tier_chunks(self) -> tuple[int, ...]:
        """Indices (in the job) of the chunks read from :attr:`tier`, in order."""
        return tuple(i for i, slot in enumerate(self.slots) if slot == NO_SLOT)

    def host_chunks(self) -> tuple[int, ...]:
        """Indices (in the job) of the chunks read from host slots, in order."""
        return tuple(i for i, slot in enumerate(self.slots) if slot != NO_SLOT)

    def part(self, chunks: Sequence[int], slots: Sequence[int]) -> EngineJob:
        """The same job (same id, request and kind) for only ``chunks`` (ascending
        indices into this job), read from ``slots`` (one per chunk: host slots, or a
        staging area's): the engine blocks of exactly those chunks, ``skip_blocks``
        kept when chunk 0 is among them. No tier fields: every chunk of a part comes
        from ``slots``."""
        k, skip = self.blocks_per_chunk, self.skip_blocks
        blocks: list[int] = []
        for c in chunks:
            blocks.extend(self.block_ids[max(0, c * k - skip) : (c + 1) * k - skip])
        return EngineJob(
            job_id=self.job_id,
            kind=self.kind,
            request_id=self.request_id,
            keys=tuple(self.keys[c] for c in chunks),
            slots=tuple(slots),
            block_ids=tuple(blocks),
            blocks_per_chunk=k,
            skip_blocks=skip if chunks and chunks[0] == 0 else 0,
        )

    def chunk_blocks(self) -> list[tuple[int, int, int]]:
        """(slot, block index inside the chunk, engine block id) for every block moved."""
        k, skip = self.blocks_per_chunk, self.skip_blocks
        return [
            (self.slots[(m + skip) // k], (m + skip) % k, block)
            for m, block in enumerate(self.block_ids)
            if block != NO_BLOCK
        ]

    def moved_blocks(self) -> tuple[int, ...]:
        """The engine blocks the job reads or writes (``block_ids`` without
        :data:`NO_BLOCK`)."""
        if NO_BLOCK not in self.block_ids:
            return self.block_ids
        return tuple(b for b in self.block_ids if b != NO_BLOCK)


@dataclass(frozen=True)
class TierJob:
    """A spill (host slots -> lower tier ``tier``) or a promotion (``tier`` -> host
    slots). ``tier_slots``: the chunks' slots in a slotted tier, one per key, or none.
    ``request_id``: the request a promotion serves; a spill serves none (None).
    ``groups``: the chunks' KV cache groups, one per key, or none (every chunk is group
    0: a one-group layout, which pays nothing for them). Read from the host directory,
    which owns a chunk's group (:class:`~kvoffload.core.directory.slots.SlotTable`);
    a spill writes them into the tier's headers, a promotion expects them back.

    Raises :class:`ContractViolation` at construction when the kind is an engine
    kind, it names no tier, the slots or groups do not match the keys, it moves
    nothing, or the request id does not fit the kind."""

    job_id: int
    kind: JobKind
    keys: tuple[ChunkKey, ...]
    slots: tuple[int, ...]
    tier: str
    tier_slots: tuple[int, ...] = ()
    request_id: str | None = None
    groups: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.kind.touches_engine:
            raise ContractViolation(f"job {self.job_id}: a {self.kind.value} is an engine job")
        if len(self.keys) != len(self.slots):
            raise ContractViolation(f"job {self.job_id}: needs one slot per key")
        if not self.slots:
            raise ContractViolation(f"job {self.job_id}: moves no chunk")
        if not self.tier:
            raise ContractViolation(f"job {self.job_id}: tier jobs name a tier")
        if self.tier_slots and len(self.tier_slots) != len(self.keys):
            raise ContractViolation(f"job {self.job_id}: one tier slot per key, or none")
        if self.groups and len(self.groups) != len(self.keys):
            raise ContractViolation(f"job {self.job_id}: one KV cache group per key, or none")
        if (self.request_id is None) != (self.kind is JobKind.SPILL):
            raise ContractViolation(
                f"job {self.job_id}: a promotion serves a request, a spill none"
            )


TransferJob: TypeAlias = EngineJob | TierJob  # either family (code that handles both)


@dataclass(frozen=True)
class StepPlan:
    """What every worker must do this step.

    ``flush``: ids of in-flight store jobs (submitted in earlier steps, or in this
    plan) whose source engine blocks are about to be overwritten; the worker must
    finish them before this step's forward pass writes KV.
    """

    step: int
    loads: tuple[EngineJob, ...] = ()
    stores: tuple[EngineJob, ...] = ()
    flush: frozenset[int] = field(default_factory=frozenset)
    spills: tuple[TierJob, ...] = ()
    promotions: tuple[TierJob, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.loads or self.stores or self.flush or self.spills or self.promotions)


@dataclass(frozen=True)
class JobResult:
    """One worker's result of one job.

    ``failed_chunks`` (tier jobs and tier loads): chunks of the job that did not make
    it, as (index in the job, :class:`ChunkFailure`), e.g.
    ``(1, ChunkFailure(FailureKind.INTEGRITY, "checksum"))`` (``str()``:
    ``"integrity:checksum"``) or ``(0, MISSING)``. For a tier job ``success=False``
    means no chunk made it; a load succeeds only when every chunk landed (the engine
    needs them all), so a tier load with a chunk missing or corrupt fails and lists
    that chunk here (the scheduler half forgets the tier's bad copy).

    ``error`` (failed jobs): why, as free text (``"worker is shut down: ..."``, the
    exception of an engine copy or of a tier that failed as a whole), or, for a tier
    job whose every chunk failed on its own, the first chunk's :class:`ChunkFailure`.
    Text is read as :data:`FailureKind.ERROR <kvoffload.core.failures.FailureKind>`;
    format either with ``str()``.
    """

    job_id: int
    success: bool
    nbytes: int = 0
    seconds: float = 0.0
    error: str | ChunkFailure = ""
    failed_chunks: tuple[tuple[int, ChunkFailure], ...] = ()


@dataclass(frozen=True)
class WorkerReport:
    """The results one worker finished since its previous report.

    ``released``: ids of tier jobs (spills, promotions) this worker reported earlier
    as timed out (a chunk failure of kind ``TIMEOUT``), whose tier I/O has now
    returned on this worker: the host slots they read or wrote are no longer touched
    there. Every such result is followed by exactly one release (none if the I/O never
    returns), in the same report or a later one."""

    rank: int
    results: tuple[JobResult, ...] = ()
    released: tuple[int, ...] = ()
