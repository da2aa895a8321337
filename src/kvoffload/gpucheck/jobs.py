"""Engine jobs the check submits, and waiting for them on the worker.

The check builds :class:`~kvoffload.core.jobs.EngineJob` s as the scheduler half would
(one key per chunk, ``blocks_per_chunk`` engine blocks per chunk) and submits them to a
:class:`~kvoffload.transfer.worker.TransferWorker`; :func:`finish` waits for them and
raises when one failed, so a failed copy is never counted as a fast one.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from kvoffload.core.jobs import EngineJob, JobKind, JobResult
from kvoffload.core.keys import ChunkKey
from kvoffload.transfer.worker import TransferWorker

_IDS = itertools.count(1)


def engine_job(
    kind: JobKind, slots: Sequence[int], blocks: Sequence[int], k: int, *, skip: int = 0
) -> EngineJob:
    """A store or load of chunks ``slots`` (one per chunk) and engine ``blocks`` (chunk
    order; ``skip`` leading blocks of chunk 0 not moved), under a fresh job id."""
    job_id = next(_IDS)
    keys = tuple(ChunkKey(i.to_bytes(16, "little")) for i in range(len(slots)))
    return EngineJob(job_id, kind, f"check{job_id}", keys, tuple(slots), tuple(blocks), k, skip)


def submit(worker: TransferWorker, job: EngineJob) -> None:
    (worker.submit_store if job.kind is JobKind.STORE else worker.submit_load)(job)


def finish(worker: TransferWorker, jobs: Sequence[EngineJob]) -> list[JobResult]:
    """Wait for ``jobs``, take every result the worker has, and raise
    :class:`RuntimeError` naming the first failed one."""
    worker.wait(job.job_id for job in jobs)
    results = worker.poll()
    failed = [r for r in results if not r.success]
    if failed:
        raise RuntimeError(f"job {failed[0].job_id} failed: {failed[0].error}")
    return results


def synchronize(device: torch.device) -> None:
    """Wait for every kernel queued on ``device`` (nothing to do on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
