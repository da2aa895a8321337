"""The engine boundary of the scheduler role: an internal error never kills vLLM.

Every call vLLM's scheduler makes into kvoffload runs under :class:`Guard`. The
first exception (a kvoffload bug: surprising input is already handled, as counted
anomalies, inside the scheduler half) is logged once with its traceback, counted
(``kvoffload_internal_errors_total``), and turns offloading *off* for the rest of
the engine's life. Off means: lookups answer 0, nothing is stored, reports are
ignored, and the engine never waits for kvoffload again. The one obligation left is
to requests vLLM already waits on: every load it was promised and that no worker has
been told to run yet goes out as a load of *invalid blocks*, which the worker
reports at once, so vLLM recomputes those blocks (loads already shipped complete in
the workers as planned).

Owned by one :class:`~kvoffload.adapters.vllm.scheduler_side.SchedulerSide`, used
under its lock.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Sequence

from kvoffload.core.jobs import EngineJob, JobKind, StepPlan
from kvoffload.core.scheduler import OffloadScheduler

logger = logging.getLogger("kvoffload")


class Guard:
    def __init__(self, scheduler: OffloadScheduler) -> None:
        self.scheduler = scheduler
        self.off = False
        self.errors: list[str] = []  # the tracebacks caught (tests and harnesses read them)
        self._owed: list[tuple[str, tuple[int, ...]]] = []  # (request id, blocks to fail)
        self._steps = 0

    def trip(self, where: str, exc: BaseException) -> None:
        """An internal error in ``where``: log it, count it, turn offloading off."""
        self.errors.append("".join(traceback.format_exception(exc)))
        self.scheduler.metrics.count("internal_errors_total")
        if self.off:
            logger.debug("kvoffload: another internal error in %s: %r", where, exc)
            return
        self.off = True
        logger.error(
            "kvoffload: internal error in %s; offloading is off for the rest of this "
            "engine's life (requests are served without it, promised loads recompute)",
            where,
            exc_info=exc,
        )
        try:
            loads = self.scheduler.take_unplanned_loads()
        except Exception:  # the half may be broken: owe what we can
            loads = []
        for job in loads:
            self.owe(job.request_id, job.moved_blocks() or job.invalid_blocks)

    def owe(self, request_id: str, blocks: Sequence[int]) -> None:
        """vLLM waits for a load into ``blocks`` that will not happen: fail them."""
        self._owed.append((request_id, tuple(blocks)))

    def plan(self) -> StepPlan:
        """The plan while off: the owed loads, as loads of invalid blocks."""
        self._steps += 1
        loads = tuple(
            EngineJob(
                job_id=self.scheduler.new_job_id(),
                kind=JobKind.LOAD,
                request_id=request_id,
                keys=(),
                slots=(),
                block_ids=(),
                blocks_per_chunk=self.scheduler.config.blocks_per_chunk,
                invalid_blocks=blocks,
            )
            for request_id, blocks in self._owed
            if blocks
        )
        self._owed = []
        return StepPlan(self.scheduler.step + self._steps, loads)
