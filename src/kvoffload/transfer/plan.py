"""From an :class:`EngineJob` to the block-by-block copy it stands for.

The host slab is addressed in *rows*: row ``slot * k + j`` is block record ``j`` of the
chunk in ``slot`` (``k = blocks_per_chunk``). A :class:`CopyPlan` pairs every engine
block a job moves with its row, following the addressing rule of
:mod:`kvoffload.core.jobs` (``skip_blocks`` leading blocks of chunk 0 are not moved),
and splits the job into *runs* of consecutive rows: a run is contiguous in the slab.

Validation is cheap (range and duplicate checks, linear in the job) and total: a job that
cannot be executed raises :class:`JobRejected`, which the worker turns into a failed
result. Nothing here touches memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvoffload.core.jobs import NO_BLOCK, EngineJob, JobKind

Index = npt.NDArray[np.int64]


class JobRejected(Exception):
    """A job the worker cannot execute (bad ids, wrong kind, wrong chunk size)."""


@dataclass(frozen=True, eq=False)
class CopyPlan:
    """Engine block ``blocks[i]`` moves to or from slab row ``rows[i]``.

    Runs are ``[bounds[r], bounds[r + 1])``: within a run, rows are consecutive.
    ``nbytes`` counts the block records moved.
    """

    job: EngineJob
    rows: Index
    blocks: Index
    bounds: Index
    nbytes: int

    @property
    def num_runs(self) -> int:
        return len(self.bounds) - 1


def plan_job(
    job: EngineJob,
    kind: JobKind,
    *,
    num_blocks: int,
    num_slots: int,
    blocks_per_chunk: int,
    block_bytes: int,
) -> CopyPlan:
    """Check ``job`` against the worker's geometry and pair its blocks with rows.

    Raises :class:`JobRejected` when the job is of the wrong kind, uses another chunk
    size, names a block or slot out of range, or names one destination twice (two
    chunks in one slot for a store, one engine block twice for a load).
    """
    if job.kind is not kind:
        raise JobRejected(f"job {job.job_id} is a {job.kind.value} job, submitted as {kind.value}")
    k = job.blocks_per_chunk
    if k != blocks_per_chunk:
        raise JobRejected(
            f"job {job.job_id}: blocks_per_chunk {k}, the worker's chunks hold {blocks_per_chunk}"
        )
    moved = job.moved_blocks()
    _check_range(job, "slot", job.slots, num_slots)
    _check_range(job, "block id", moved, num_blocks)
    dest = job.slots if kind is JobKind.STORE else moved
    if len(set(dest)) != len(dest):
        name = "slot" if kind is JobKind.STORE else "block id"
        raise JobRejected(f"job {job.job_id}: a {name} is written twice")
    slots = np.fromiter(job.slots, dtype=np.int64, count=len(job.slots))
    blocks = np.fromiter(job.block_ids, dtype=np.int64, count=len(job.block_ids))
    pos = np.arange(job.skip_blocks, job.skip_blocks + len(blocks), dtype=np.int64)
    if len(moved) != len(blocks):  # NO_BLOCK entries: not moved
        keep = blocks != NO_BLOCK
        blocks, pos = blocks[keep], pos[keep]
    rows = slots[pos // k] * k + pos % k
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    bounds = np.concatenate(([0], breaks, [len(rows)])).astype(np.int64)
    return CopyPlan(job, rows, blocks, bounds, len(blocks) * block_bytes)


def _check_range(job: EngineJob, what: str, ids: tuple[int, ...], limit: int) -> None:
    if min(ids) < 0 or max(ids) >= limit:
        bad = next(i for i in ids if not 0 <= i < limit)
        raise JobRejected(f"job {job.job_id}: {what} {bad} out of range [0, {limit})")


def merge_plans(plans: list[CopyPlan]) -> CopyPlan:
    """One plan copying everything ``plans`` copy (jobs of one direction whose
    destinations are disjoint, as the scheduler half guarantees). Its ``job`` is the
    first plan's; only the copier, which ignores it, runs a merged plan."""
    if len(plans) == 1:
        return plans[0]
    rows = np.concatenate([p.rows for p in plans])
    blocks = np.concatenate([p.blocks for p in plans])
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    bounds = np.concatenate(([0], breaks, [len(rows)])).astype(np.int64)
    return CopyPlan(plans[0].job, rows, blocks, bounds, sum(p.nbytes for p in plans))
