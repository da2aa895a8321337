"""The simulated worker half: transfer jobs take the cost model's time on lanes.

Each job occupies one lane, first come first served: loads the host -> engine lane,
stores the engine -> host lane, spills and promotions the lane of their lower tier.
A tier load (a load reading some chunks straight from a lower tier) occupies three:
its host chunks the host -> engine lane, its tier chunks the tier's lane for the read
(at the tier's bandwidth, as a promotion's) and then the tier's staging lane
(``<tier>->engine``, at the host bandwidth) for the copy into the engine, as the
real worker reads and copies them on one lane per tier: the read waits for the
tier's previous tier load's copy. The job finishes when both halves did.

A job starts when it is planned (a store: after the forward pass of its step, whose
KV it captures; a store the plan flushes: before the forward pass, which waits for
it) and is reported at the end of the first step that ends after it finished. No
bytes move and no job fails. The worker also keeps the traffic counters (chunks per
job kind and tier, a tier load's host and tier chunks apart; lane busy seconds;
with several KV cache groups, loads' and stores' chunks per group, read from the
engine's block owners when submitted).

:class:`SimClock` is the simulated time, shared by the driver, the engine's meter
and this worker; a step's end is ``start + flush stall + compute``.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvoffload.core.jobs import (
    NO_BLOCK,
    EngineJob,
    JobKind,
    JobResult,
    StepPlan,
    TierJob,
    TransferJob,
    WorkerReport,
)
from kvoffload.simulate.cost import CostModel
from kvoffload.simulate.request import StepMeter

_NOTHING = WorkerReport(0, ())


@dataclass
class SimClock:
    """Simulated seconds. ``now`` is the current step's start, ``step_end`` its end
    (valid once the forward pass was costed)."""

    now: float = 0.0
    step_end: float = 0.0
    stall_s: float = 0.0  # this step's wait for flushed stores
    stalled_total_s: float = 0.0

    def end_step(self, meter: StepMeter, cost: CostModel) -> float:
        """Cost the step's forward pass; return (and remember) the step's end."""
        compute = cost.compute_seconds(meter.prefill, meter.decode)
        self.step_end = self.now + self.stall_s + compute
        self.stalled_total_s += self.stall_s
        self.stall_s = 0.0
        return self.step_end


@dataclass
class Traffic:
    """Chunks moved by completed jobs: ``chunks[(kind, tier)]``; kind is a JobKind
    value, tier ``"host"`` for loads and stores (a tier load's tier chunks: its tier)."""

    chunks: Counter[tuple[str, str]] = field(default_factory=Counter)
    busy_s: dict[str, float] = field(default_factory=dict)  # per lane
    jobs: Counter[str] = field(default_factory=Counter)  # per kind
    groups: Counter[tuple[str, int]] = field(default_factory=Counter)  # (kind, KV group)


class SimWorker:
    """A :class:`~kvoffload.core.step_runner.StepBackend` over simulated lanes (the
    engine drives it through a :class:`~kvoffload.core.step_runner.StepRunner`).

    Owns the lanes and the jobs in flight; reads the shared clock and meter, and
    sets the clock's flush stall and step end. ``group_of``: the KV cache group of
    each engine block (the engine's, read only), None with one group."""

    def __init__(
        self,
        cost: CostModel,
        chunk_bytes: int,
        clock: SimClock,
        meter: StepMeter,
        group_of: Sequence[int] | None = None,
    ) -> None:
        self.cost = cost
        self.chunk_bytes = chunk_bytes
        self.clock = clock
        self.meter = meter
        self.free_at: dict[str, float] = {}
        self.finish_of: dict[int, float] = {}
        self._heap: list[tuple[float, int, TransferJob]] = []
        self._after_forward = False  # jobs submitted now start at the step's end
        self.traffic = Traffic()
        self.completed_last_step = 0
        self.group_of = group_of
        self._job_groups: dict[int, list[int]] = {}  # engine job -> group of each chunk

    @staticmethod
    def _lane(job: TransferJob) -> tuple[str, str]:
        """(lane name, cost lane) of a job."""
        if isinstance(job, TierJob):
            return job.tier, job.tier  # the tier's own lane
        if job.kind is JobKind.LOAD:
            return "host->engine", "host"
        return "engine->host", "host"

    def _start(self, job: TransferJob, at: float) -> float:
        if isinstance(job, EngineJob) and job.tier is not None:
            finish = self._start_tier_load(job, at)
        else:
            lane, cost_lane = self._lane(job)
            seconds = self.cost.copy_seconds(len(job.keys) * self.chunk_bytes, cost_lane)
            finish = self._occupy(lane, max(at, self.free_at.get(lane, 0.0)), seconds)
        self.finish_of[job.job_id] = finish
        heapq.heappush(self._heap, (finish, job.job_id, job))
        return finish

    def _occupy(self, lane: str, start: float, seconds: float) -> float:
        """``lane`` busy from ``start`` for ``seconds``; returns the end."""
        self.free_at[lane] = start + seconds
        self.traffic.busy_s[lane] = self.traffic.busy_s.get(lane, 0.0) + seconds
        return start + seconds

    def _tier_load_costs(self, job: EngineJob) -> tuple[float, float, float]:
        """(host chunks' copy, tier chunks' read, their staging copy) in seconds."""
        tier_chunks = len(job.tier_chunks())
        host_bytes = (len(job.keys) - tier_chunks) * self.chunk_bytes
        tier_bytes = tier_chunks * self.chunk_bytes
        read_lane = job.tier or "host"  # a tier load always names its tier
        return (
            self.cost.copy_seconds(host_bytes, "host"),
            self.cost.copy_seconds(tier_bytes, read_lane),
            self.cost.copy_seconds(tier_bytes, "host"),
        )

    def _start_tier_load(self, job: EngineJob, at: float) -> float:
        """Occupy a tier load's lanes (module docstring); returns when it finishes."""
        host_s, read_s, copy_s = self._tier_load_costs(job)
        tier, stage, host = job.tier or "", f"{job.tier}->engine", "host->engine"
        finish = at
        if host_s:
            finish = self._occupy(host, max(at, self.free_at.get(host, 0.0)), host_s)
        read_at = max(at, self.free_at.get(tier, 0.0), self.free_at.get(stage, 0.0))
        copied = self._occupy(stage, self._occupy(tier, read_at, read_s), copy_s)
        return max(finish, copied)

    # ------------------------------------------------------------ backend calls

    def begin(self, plan: StepPlan) -> None:
        self._after_forward = False
        self.clock.stall_s = 0.0

    def submit(self, job: TransferJob) -> None:
        """Queue ``job`` on its lane from the step's start (before the forward pass)
        or its end (after it)."""
        if self.group_of is not None and isinstance(job, EngineJob):
            self._job_groups[job.job_id] = self._chunk_groups(job)
        self._start(job, self.clock.step_end if self._after_forward else self.clock.now)

    def _chunk_groups(self, job: EngineJob) -> list[int]:
        """The group of each chunk of ``job``: its blocks' (they belong to the group
        while the job is submitted; a chunk's first block moved decides)."""
        assert self.group_of is not None
        groups: dict[int, int] = {}
        k, skip = job.blocks_per_chunk, job.skip_blocks
        for m, block in enumerate(job.block_ids):
            if block != NO_BLOCK:
                groups.setdefault((m + skip) // k, self.group_of[block])
        return [groups.get(chunk, -1) for chunk in range(len(job.slots))]

    def wait(self, job_ids: frozenset[int]) -> None:
        """The forward pass starts once the named jobs finished: the clock's stall."""
        now = self.clock.now
        ready = max((self.finish_of.get(job_id, now) for job_id in job_ids), default=now)
        self.clock.stall_s = max(ready, now) - now

    def end_forward(self) -> None:
        """Cost the forward pass (the step ends); later jobs start at its end."""
        self.clock.end_step(self.meter, self.cost)
        self._after_forward = True

    def poll(self) -> list[WorkerReport]:
        """Report the jobs finished by the step's end, in finishing order."""
        end = self.clock.step_end
        if not self._heap or self._heap[0][0] > end:
            self.completed_last_step = 0
            return [_NOTHING]
        results = []
        while self._heap and self._heap[0][0] <= end:
            _, job_id, job = heapq.heappop(self._heap)
            del self.finish_of[job_id]
            self._count(job)
            nbytes = len(job.keys) * self.chunk_bytes
            if isinstance(job, EngineJob) and job.tier is not None:
                host_s, read_s, copy_s = self._tier_load_costs(job)
                seconds = max(host_s, read_s + copy_s)
            else:
                seconds = self.cost.copy_seconds(nbytes, self._lane(job)[1])
            results.append(JobResult(job_id, True, nbytes, seconds))
        self.completed_last_step = len(results)
        return [WorkerReport(0, tuple(results))]

    def _count(self, job: TransferJob) -> None:
        """A finished job's traffic: its chunks per (kind, tier), a tier load's tier
        chunks under its tier and its host chunks under ``host``."""
        kind = job.kind.value
        if isinstance(job, TierJob):
            self.traffic.chunks[(kind, job.tier)] += len(job.keys)
        elif job.tier is not None:
            tier_chunks = len(job.tier_chunks())
            self.traffic.chunks[(kind, job.tier)] += tier_chunks
            self.traffic.chunks[(kind, "host")] += len(job.keys) - tier_chunks
        else:
            self.traffic.chunks[(kind, "host")] += len(job.keys)
        self.traffic.jobs[kind] += 1
        if self._job_groups:
            for group in self._job_groups.pop(job.job_id, ()):
                self.traffic.groups[(kind, group)] += 1

    def applied(self, reports: Sequence[WorkerReport]) -> None:
        """Nothing to do: the simulated jobs hold no state past their report."""

    def next_finish(self) -> float | None:
        """When the next job in flight finishes (None: nothing in flight)."""
        return self._heap[0][0] if self._heap else None
