"""A harness step's record and its lines in the run's trace.

:class:`StepRecord` is what one scheduled engine step planned and what its workers
reported back (kvoffload's plan under test, and the plans of the connectors beside
it under ``MultiConnector``); :func:`plan_lines` renders it for the trace a failure
report prints. Both are plain values: nothing here touches the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvoffload.core.jobs import EngineJob, StepPlan, TransferJob


@dataclass
class StepRecord:
    step: int
    plan: StepPlan
    scheduled: dict[str, int]
    preempted: set[str]
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)  # loads failed, by request
    invalid_blocks: set[int] = field(default_factory=set)
    beside: tuple[StepPlan, ...] = ()  # the plans of the connectors beside kvoffload

    def loads_for(self, request_id: str) -> list[EngineJob]:
        return [j for j in self.plan.loads if j.request_id == request_id]


def plan_lines(record: StepRecord) -> list[str]:
    """The trace lines of one step: what was scheduled and preempted, every job each
    connector planned, and its flushes."""
    lines: list[str] = []
    sched = ", ".join(f"{r}+{n}" for r, n in record.scheduled.items()) or "-"
    line = f"step {record.step}: scheduled {sched}"
    if record.preempted:
        line += f"; preempted {sorted(record.preempted)}"
    lines.append(line)
    for i, plan in enumerate((*record.beside, record.plan)):
        who = f"[beside {i}] " if i < len(record.beside) else ""
        jobs: tuple[TransferJob, ...] = (
            *plan.loads,
            *plan.stores,
            *plan.spills,
            *plan.promotions,
        )
        for job in jobs:
            where = f"blocks {list(job.block_ids)}" if isinstance(job, EngineJob) else job.tier
            lines.append(
                f"    {who}{job.kind.value} {job.job_id} {job.request_id or '-'}: "
                f"{len(job.keys)} chunks, {where}"
            )
        if plan.flush:
            lines.append(f"    {who}flush {sorted(plan.flush)}")
    return lines
