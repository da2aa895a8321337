"""The simulated worker half: transfer jobs take the cost model's time on lanes.

Each leg of a job (:func:`kvoffload.core.tiering.routes.legs`) occupies the lanes of its
route (one table, ``_LANES``), first come first served, one after the other, from
when every one of them is free: a load's leg from host memory the host -> engine
lane, a store the engine -> host lane, spills and promotions the lane of their lower
tier; a leg from a lower tier into the engine (a tier load's) the tier's lane for the
read (at the tier's bandwidth, as a promotion's) and then the tier's staging lane
(``<tier>->engine``, at the host bandwidth) for the copy into the engine, as the
real worker reads and copies them on one lane per tier: the read waits for the
tier's previous tier load's copy. A job finishes when its last leg did; its result
merges its legs' (:func:`kvoffload.core.tiering.routes.merge`: bytes summed, the longest
leg's seconds).

Codecs (:mod:`kvoffload.simulate.codecs`): a lower tier's lane moves its chunks as the
tier holds them (encoded by its codec); a link into or out of the engine (host memory's
two lanes, a tier load's staging copy) moves them encoded where the GPU codes them
(fp8 by default, its coding taken as free) and raw where the CPU does. The CPU's coding
keeps the leg's last lane busy too, at the codec's speed in raw bytes: a store encodes
(host memory's codec), a load from host memory or a tier decodes (that tier's codec),
and a spill or promotion between tiers of different codecs decodes one and encodes the
other (between tiers of one codec the encoded bytes move as they are).

A job starts when it is planned (a store: after the forward pass of its step, whose
KV it captures; a store the plan flushes: before the forward pass, which waits for
it) and is reported at the end of the first step that ends after it finished. No
bytes move and no job fails. The worker also keeps the traffic counters (chunks per
job kind and the tier each leg reads or writes, a tier load's host and tier chunks
apart; lane busy seconds;
with several KV cache groups, loads' and stores' chunks per group, read from the
engine's block owners when submitted).

:class:`SimClock` is the simulated time, shared by the driver, the engine's meter
and this worker; a step's end is ``start + flush stall + compute``.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvoffload.core.jobs import (
    NO_BLOCK,
    EngineJob,
    JobResult,
    StepPlan,
    TransferJob,
    WorkerReport,
)
from kvoffload.core.tiering.routes import (
    FROM_HOST,
    FROM_TIER,
    PROMOTE,
    SPILL,
    TO_HOST,
    Leg,
    Route,
    legs,
    merge,
)
from kvoffload.simulate.codecs import TierCodec, transcode_seconds
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
    value, tier the lower tier a leg reads or writes, else ``"host"`` (a tier load's
    tier chunks count under its tier, its host chunks under ``"host"``)."""

    chunks: Counter[tuple[str, str]] = field(default_factory=Counter)
    busy_s: dict[str, float] = field(default_factory=dict)  # per lane
    codec_s: dict[str, float] = field(default_factory=dict)  # per lane: of busy_s, coding
    jobs: Counter[str] = field(default_factory=Counter)  # per kind
    groups: Counter[tuple[str, int]] = field(default_factory=Counter)  # (kind, KV group)


class SimWorker:
    """A :class:`~kvoffload.core.step_runner.StepBackend` over simulated lanes (the
    engine drives it through a :class:`~kvoffload.core.step_runner.StepRunner`).

    Owns the lanes and the jobs in flight; reads the shared clock and meter, and
    sets the clock's flush stall and step end. ``group_of``: the KV cache group of
    each engine block (the engine's, read only), None with one group. ``codecs``: each
    tier's codec by name (a tier not named: none, chunks of ``chunk_bytes``)."""

    def __init__(
        self,
        cost: CostModel,
        chunk_bytes: int,
        clock: SimClock,
        meter: StepMeter,
        group_of: Sequence[int] | None = None,
        *,
        codecs: Mapping[str, TierCodec] | None = None,
    ) -> None:
        self.cost = cost
        self.chunk_bytes = chunk_bytes
        self.codecs = dict(codecs or {})
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

    def _start(self, job: TransferJob, at: float) -> None:
        """Occupy the lanes of every leg of ``job`` from ``at``; note when it finishes
        (its last leg; a job with no leg: at once)."""
        finish = max((self._run_leg(leg, at) for leg in legs(job)), default=at)
        self.finish_of[job.job_id] = finish
        heapq.heappush(self._heap, (finish, job.job_id, job))

    def _run_leg(self, leg: Leg, at: float) -> float:
        """Occupy ``leg``'s lanes one after the other, from when all are free; its end."""
        stages = _LANES[leg.route](leg)
        end = max(at, *(self.free_at.get(lane, 0.0) for lane, _ in stages))
        timed = self._stage_seconds(leg, stages)
        coding = self._coding_seconds(leg)
        if coding:
            last = timed[-1][0]
            self.traffic.codec_s[last] = self.traffic.codec_s.get(last, 0.0) + coding
        for lane, seconds in timed:
            end = self._occupy(lane, end, seconds)
        return end

    def _codec(self, tier: str) -> TierCodec:
        """The codec of ``tier`` (``"host"`` or a lower tier's name)."""
        codec = self.codecs.get(tier)
        return codec if codec is not None else TierCodec.raw(self.chunk_bytes)

    def _coding_seconds(self, leg: Leg) -> float:
        """CPU seconds ``leg`` spends encoding and decoding (module docstring)."""
        n = len(leg.chunks)
        source, destination = leg.source.name, leg.destination.name
        if source == "engine":  # a store
            return self._codec(destination).store_seconds(n)
        if destination == "engine":  # a load from host memory or a tier
            return self._codec(source).load_seconds(n)
        return transcode_seconds(self._codec(source), self._codec(destination), n)

    def _stage_bytes(self, leg: Leg, cost_lane: str) -> int:
        """Bytes ``leg`` moves on a stage costed at ``cost_lane``: a lower tier's lane
        moves its chunks encoded, an engine link (costed at host memory's bandwidth)
        as the tier at the leg's other end codes them for the engine."""
        n = len(leg.chunks)
        if cost_lane != "host":
            return n * self._codec(cost_lane).chunk_bytes
        return n * self._codec(leg.tier or "host").engine_link_bytes

    def _stage_seconds(
        self, leg: Leg, stages: tuple[tuple[str, str], ...]
    ) -> list[tuple[str, float]]:
        """(lane, seconds) of each stage of ``leg``: its bytes at the stage's cost lane,
        the last stage also coding them."""
        timed = [
            (lane, self.cost.copy_seconds(self._stage_bytes(leg, cost_lane), cost_lane))
            for lane, cost_lane in stages
        ]
        coding = self._coding_seconds(leg)
        if coding:
            lane, seconds = timed[-1]
            timed[-1] = (lane, seconds + coding)
        return timed

    def _leg_result(self, job_id: int, leg: Leg) -> JobResult:
        """A finished leg's result: its bytes (its first stage's: what it read) and
        its stages' seconds."""
        stages = _LANES[leg.route](leg)
        seconds = sum(s for _, s in self._stage_seconds(leg, stages))
        return JobResult(job_id, True, self._stage_bytes(leg, stages[0][1]), seconds)

    def _occupy(self, lane: str, start: float, seconds: float) -> float:
        """``lane`` busy from ``start`` for ``seconds``; returns the end."""
        self.free_at[lane] = start + seconds
        self.traffic.busy_s[lane] = self.traffic.busy_s.get(lane, 0.0) + seconds
        return start + seconds

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
            job_legs = legs(job)
            self._count(job, job_legs)
            results.append(merge(job_id, [self._leg_result(job_id, leg) for leg in job_legs]))
        self.completed_last_step = len(results)
        return [WorkerReport(0, tuple(results))]

    def _count(self, job: TransferJob, job_legs: Sequence[Leg]) -> None:
        """A finished job's traffic: each leg's chunks per (kind, the leg's tier)."""
        kind = job.kind.value
        for leg in job_legs:
            self.traffic.chunks[(kind, leg.tier or "host")] += len(leg.chunks)
        self.traffic.jobs[kind] += 1
        if self._job_groups:
            for group in self._job_groups.pop(job.job_id, ()):
                self.traffic.groups[(kind, group)] += 1

    def applied(self, reports: Sequence[WorkerReport]) -> None:
        """Nothing to do: the simulated jobs hold no state past their report."""

    def next_finish(self) -> float | None:
        """When the next job in flight finishes (None: nothing in flight)."""
        return self._heap[0][0] if self._heap else None


_LANES: dict[Route, Callable[[Leg], tuple[tuple[str, str], ...]]] = {
    # a leg's route -> its stages, in order: (lane, cost lane it is costed at)
    FROM_HOST: lambda leg: (("host->engine", "host"),),
    TO_HOST: lambda leg: (("engine->host", "host"),),
    SPILL: lambda leg: ((leg.destination.name, leg.destination.name),),
    PROMOTE: lambda leg: ((leg.source.name, leg.source.name),),
    FROM_TIER: lambda leg: (
        (leg.source.name, leg.source.name),
        (f"{leg.source.name}->engine", "host"),
    ),
}
