"""The reference engine's worker's legs to and from its in-memory lower tiers (see
:mod:`kvoffload.engine.manual_worker`, whose route table runs them): spills, promotions
and a tier load's leg from its tier, each checking what the scheduler half promised
(:class:`InvariantViolation`) as the module docstring there says. Each mutates the
worker's host slots, its in-memory tiers or the engine's blocks, and returns the leg's
:class:`JobResult`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Protocol

from kvoffload.core.failures import ChunkFailure, integrity_failure
from kvoffload.core.jobs import EngineJob, JobResult, TierJob, TransferJob
from kvoffload.core.keys import ChunkKey
from kvoffload.core.tiering.routes import Leg
from kvoffload.engine.memory_tiers import TORN_BYTES, InvariantViolation, MemoryTiers

Failures = tuple[tuple[int, ChunkFailure], ...]  # (index of a chunk in the job, why)

TORN = integrity_failure("checksum")
"""How a damaged tier slot reads: the checksum of a torn write does not match."""


class LegWorker(Protocol):
    """What the tier legs use of the reference worker
    (:class:`~kvoffload.engine.manual_worker.ManualWorker`): its host slots and their
    keys, the bytes every verified store captured, its in-memory tiers, the step, a
    failed tier load's chunks, and its checks and block writes."""

    host: list[bytes | None]
    host_key: list[ChunkKey | None]
    known: dict[ChunkKey, bytes]
    tiers: MemoryTiers
    step: int
    fail_tier_load: Callable[[EngineJob], Failures]

    def what(self, job: TransferJob) -> str: ...

    def verify(self, job: EngineJob, chunk: int, data: bytes, what: str) -> None: ...

    def write_blocks(
        self, job: EngineJob, chunks: dict[int, bytes], *, garbage: Collection[int]
    ) -> None: ...


def slots_below(worker: LegWorker, job: TransferJob, leg: Leg) -> tuple[int, ...]:
    """The tier slots of ``leg``'s chunks, one each (the in-memory tiers are
    slotted: a job without them is a violation)."""
    if len(job.tier_slots) != len(leg.chunks):
        raise InvariantViolation(f"{worker.what(job)} without tier slots")
    return job.tier_slots


def spill(worker: LegWorker, job: TransferJob, leg: Leg, success: bool) -> JobResult:
    """Host slots -> the in-memory tier (a failed spill writes torn chunks); every
    host slot must hold its chunk's bytes."""
    assert isinstance(job, TierJob)
    tier_slots = slots_below(worker, job, leg)
    groups = job.groups or (0,) * len(job.keys)
    for key, slot, tier_slot, group in zip(job.keys, job.slots, tier_slots, groups, strict=True):
        held = worker.host[slot]
        if held is None or worker.host_key[slot] != key or held != worker.known.get(key):
            raise InvariantViolation(
                f"step {worker.step}: spill job {job.job_id} reads slot {slot}, which does "
                "not hold the chunk's bytes"
            )
        worker.tiers.write(
            leg.destination.name, tier_slot, key, held if success else TORN_BYTES, group
        )
    return JobResult(job.job_id, success, len(leg.chunks), 0.0)


def promote(worker: LegWorker, job: TransferJob, leg: Leg, success: bool) -> JobResult:
    """The in-memory tier -> host slots, slot-addressed like the disk tier
    (authoritative: a tier slot that does not hold its chunk, or holds it as
    another KV cache group than the job expects, is a violation, which catches a
    slot reused while still needed). A damaged chunk fails (its host slot torn);
    the promotion succeeds when some chunk made it; a promotion the policy fails
    fails whole (every host slot torn)."""
    assert isinstance(job, TierJob)
    tier_slots = slots_below(worker, job, leg)
    groups = job.groups or (0,) * len(job.keys)
    failed: list[tuple[int, ChunkFailure]] = []
    each = zip(job.keys, job.slots, tier_slots, groups, strict=True)
    for i, (key, slot, tier_slot, group) in enumerate(each):
        if not success:
            worker.host[slot], worker.host_key[slot] = TORN_BYTES, None  # a torn copy
            continue
        stored = worker.tiers.read(
            worker.what(job), leg.source.name, tier_slot, key, group, job_id=job.job_id
        )
        if stored is None:
            failed.append((i, TORN))
            worker.host[slot], worker.host_key[slot] = TORN_BYTES, None
            continue
        worker.host[slot], worker.host_key[slot] = stored, key
    return _result(job.job_id, success and len(failed) < len(job.keys), leg, tuple(failed))


def load_from_tier(worker: LegWorker, job: TransferJob, leg: Leg, success: bool) -> JobResult:
    """A tier load's chunks from the in-memory tier (see the module docstring),
    each checked as a promotion's: their blocks are written only when every one
    was verified and the policy did not fail the job; the leg succeeds then."""
    assert isinstance(job, EngineJob)
    tier = leg.source.name
    tier_slots = slots_below(worker, job, leg)
    groups = job.groups or (0,) * len(leg.chunks)
    data: dict[int, bytes] = {}
    failed: dict[int, ChunkFailure] = {}
    for c, tier_slot, group in zip(leg.chunks, tier_slots, groups, strict=True):
        stored = worker.tiers.read(
            worker.what(job), tier, tier_slot, job.keys[c], group, job_id=job.job_id
        )
        if stored is None:
            failed[c] = TORN
        else:
            worker.verify(job, c, stored, "tier load read")
            data[c] = stored
    if not success:
        slots = dict(zip(leg.chunks, tier_slots, strict=True))
        for c, failure in worker.fail_tier_load(job):
            failed.setdefault(c, failure)
            if failure.copy_gone:  # the tier found its copy bad or gone: dropped
                worker.tiers.drop(tier, slots[c], by=job.job_id)
    if not failed:  # a bad tier chunk: the tier chunks never reach their blocks
        worker.write_blocks(job, data, garbage=())
    return _result(job.job_id, success and not failed, leg, tuple(sorted(failed.items())))


def _result(job_id: int, done: bool, leg: Leg, failed: Failures) -> JobResult:
    """A leg's result: ``error`` its first failed chunk's failure when it failed."""
    error: str | ChunkFailure = failed[0][1] if failed and not done else ""
    return JobResult(job_id, done, len(leg.chunks), 0.0, error, failed)
