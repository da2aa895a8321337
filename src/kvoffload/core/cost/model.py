"""The scheduler half's cost model: lanes, prefill speed, verdicts (decision 0013).

:class:`CostModel` is the one owner of the lane models (one per lane: ``host`` for
host memory -> engine, one per lower tier for its reads), the prefill meter, each
lane's verdict and each lower tier's lane's probe. It learns from completed jobs
(:meth:`observe`: successful loads and promotions; stores and spills move the other
way and teach nothing about reads) and from plans (:meth:`on_step`), and decides one
part of a hit (:meth:`decide`), reading the work queued on the lane from the jobs in
flight it is given. A lower tier's lane it declined is re-measured by a probe now and
then (:meth:`offer_probe`, :mod:`.probing`), so a tier that turns fast again is loaded
from again.

Job timings are read through ``timing`` (default: the worker's measured seconds). The
harnesses replace it with :func:`fixed_timing` so decisions are reproducible whatever
the worker threads' real timings; the simulator's workers report simulated seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple

from kvoffload.core.cost.decision import Decline, LaneDecision, Verdict, decide_lane
from kvoffload.core.cost.lanes import LaneModel
from kvoffload.core.cost.prefill import PrefillMeter
from kvoffload.core.cost.probing import PROBE_CHUNKS, LaneProbe, ProbeState
from kvoffload.core.failures import FailureKind
from kvoffload.core.jobs import NO_SLOT, JobKind, JobResult, TierJob, TransferJob

HOST = "host"
"""Host memory's lane: learned and shown, never decided on (the scheduler half loads a
host-held head always: a host copy is memcpy-fast, and a timing that says otherwise is
the worker's own queueing or noise, not a slow bus)."""
HYSTERESIS = 0.2
SHARED_ENGINE_WEIGHT = 2.0
"""While other requests share the engine, recomputing a part costs them its engine time
too, while loading it waits on a lane the engine does not need: a load is then preferred
up to this many times the part's recompute time (alone, the engine's time counts once).
On the capped chat (bench/e2e.py --workload slowtiers) loading every hit beats no
offload at 1x the recompute speed and loses at 0.3x; 2 puts the break-even between."""
MAX_REMEMBERED = 4096
"""Planned jobs whose queue ahead is remembered before the memory is pruned to the jobs
still in flight (completed ones are not removed one by one: a job's results may come
from several workers)."""

JobTiming = Callable[[TransferJob, JobResult], float]
"""The seconds a completed job's result counts for (the cost model learns from them)."""


def measured_timing(job: TransferJob, result: JobResult) -> float:
    """The worker's own measurement."""
    return result.seconds


class LaneCosts(NamedTuple):
    """A fixed cost of a lane: ``latency_s + chunks * s_per_chunk``."""

    latency_s: float = 0.0
    s_per_chunk: float = 0.0


def fixed_timing(costs: Mapping[str, LaneCosts]) -> JobTiming:
    """A timing that ignores the measurement: a job takes its lane's fixed cost (lanes
    not named cost nothing). For harnesses, explorers and tests."""

    def timing(job: TransferJob, result: JobResult) -> float:
        part = lane_part(job)
        if part is None:
            return result.seconds
        cost = costs.get(part[0], LaneCosts())
        return cost.latency_s + part[1] * cost.s_per_chunk

    return timing


def lane_part(job: TransferJob) -> tuple[str, int] | None:
    """(lane, chunks) a job's timing teaches about, or None (stores, spills, empty
    loads). A tier load counts for its tier's lane (its slower part), with its tier
    chunks."""
    if isinstance(job, TierJob):
        return (job.tier, len(job.keys)) if job.kind is JobKind.PROMOTE and job.keys else None
    if job.kind is not JobKind.LOAD or not job.keys:
        return None
    if job.tier is None:
        return HOST, len(job.keys)
    return job.tier, job.slots.count(NO_SLOT)


def timed_out(result: JobResult) -> bool:
    """A failed result whose every chunk failed for its deadline."""
    failed = result.failed_chunks
    return (
        not result.success
        and bool(failed)
        and all(f.kind is FailureKind.TIMEOUT for _, f in failed)
    )


class CostModel:
    """See the module docstring. ``always``: the configured ``load_policy`` is
    ``always`` (every hit is taken; the model still learns, for the metrics)."""

    def __init__(
        self,
        *,
        prefill_tokens_per_s: float,
        always: bool,
        in_flight: Callable[[], Iterable[TransferJob]],
        clock: Callable[[], float],
        timing: JobTiming = measured_timing,
    ) -> None:
        self.always = always
        self.timing = timing
        self.prefill = PrefillMeter(prefill_tokens_per_s)
        self.lanes: dict[str, LaneModel] = {}
        self.verdicts: dict[str, Verdict] = {}
        self.probes: dict[str, LaneProbe] = {}  # lower tiers' lanes decided on
        self._plans = 0  # plans counted by on_step (an offered probe lapses by them)
        self._in_flight = in_flight
        self._clock = clock
        self._probe_since: dict[str, float] = {}  # unmeasured lanes: their probe's start
        self._ahead: dict[int, int] = {}  # job id -> chunks queued on its lane when planned

    def lane(self, name: str) -> LaneModel:
        lane = self.lanes.get(name)
        if lane is None:
            lane = self.lanes[name] = LaneModel(name)
        return lane

    def planned(self, job: TransferJob) -> bool:
        """``job`` is about to be tracked: the chunks queued on its lane ahead of it are
        remembered until it completes (its timing counts them). Call before tracking.
        True when ``job`` is its lane's probe (planned for the request the probe was
        offered to): the caller counts it (``cost_probes_total``)."""
        part = lane_part(job)
        if part is None:
            return False
        if len(self._ahead) >= MAX_REMEMBERED:  # keep only the jobs still in flight
            live = {j.job_id for j in self._in_flight()}
            self._ahead = {k: v for k, v in self._ahead.items() if k in live}
        self._ahead[job.job_id] = self.queued_chunks(part[0])
        probe = self.probes.get(part[0])
        return probe is not None and probe.planned(job.job_id, job.request_id, self._clock())

    def observe(self, job: TransferJob, result: JobResult) -> None:
        """One worker's result of ``job``: teaches its lane (successful reads, and reads
        that timed out: they took at least their deadline, which the worker reports as
        their seconds). Every worker's result counts the job's queue ahead; completed
        jobs' entries are pruned in bulk (:meth:`planned`), so memory stays bounded,
        O(1) amortized. The first result of a lane's probe ends the probe (whatever it
        says; what it cost prices the next one) and, when it teaches, starts the lane's
        window again (:meth:`LaneModel.restart`)."""
        part = lane_part(job)
        if part is None:
            return
        name, chunks = part
        seconds = self.timing(job, result)
        probe = self.probes.get(name)
        first_of_probe = probe is not None and probe.result(job.job_id, self._clock(), seconds)
        if not (result.success or timed_out(result)):
            return
        nbytes = result.nbytes * chunks // max(1, len(job.keys))
        ahead = self._ahead.get(job.job_id, 0)
        lane = self.lane(name)
        (lane.restart if first_of_probe else lane.observe)(chunks, nbytes, seconds, ahead)

    def on_step(self, now: float, scheduled_tokens: int) -> None:
        """A plan at ``now`` scheduled ``scheduled_tokens``: the prefill meter learns; a
        probe offered and not planned by the second plan since lapses, one in flight
        whose job left the tracker without a result ends."""
        self.prefill.step(now, scheduled_tokens)
        self._plans += 1
        probes = [p for p in self.probes.values() if p.state is not ProbeState.IDLE]
        if not probes:
            return
        flying = any(p.state is ProbeState.IN_FLIGHT for p in probes)
        live = {j.job_id for j in self._in_flight()} if flying else set()
        for probe in probes:
            probe.on_plan(self._plans, now, live)

    def queued_chunks(self, name: str) -> int:
        """Chunks of the jobs in flight that read on lane ``name``."""
        total = 0
        for job in self._in_flight():
            part = lane_part(job)
            if part is not None and part[0] == name:
                total += part[1]
        return total

    def recompute_s(self, tokens: int, *, shared: bool = False) -> float:
        """Seconds recomputing ``tokens`` costs, as the decision counts them
        (``shared``: other requests share the engine)."""
        weight = SHARED_ENGINE_WEIGHT if shared else 1.0
        return max(0, tokens) / self.prefill.tokens_per_s() * weight

    def slower(self, name: str, chunks: int, recompute_s: float) -> bool:
        """Whether loading ``chunks`` chunks on lane ``name`` is known to be slower than
        ``recompute_s``: its idle estimate is, or (unmeasured) its probe has been in
        flight longer; never while the lane's probe is due (its hit would be loaded as
        the probe). No side effect."""
        probe = self.probes.get(name)
        if probe is not None and probe.due(self._clock()):
            return False
        idle = self.lane(name).seconds(chunks)
        if idle is not None:
            return idle > recompute_s
        age = self._probe_age(name, self.queued_chunks(name))
        return age is not None and age > recompute_s

    def _probe_age(self, name: str, in_flight: int) -> float | None:
        """How long unmeasured lane ``name``'s probe has been in flight (None: none is,
        ``in_flight`` chunks queued on it being 0, or its start is not known)."""
        since = self._probe_since.get(name)
        if in_flight == 0 or since is None:
            return None
        return max(0.0, self._clock() - since)

    def decide(self, name: str, chunks: int, tokens: int, *, shared: bool = False) -> LaneDecision:
        """Load ``chunks`` chunks (``tokens`` tokens) on lane ``name``, or recompute
        them (``shared``: other requests share the engine; see
        :data:`SHARED_ENGINE_WEIGHT`); moves the lane's verdict (hysteresis), and a
        lower tier's probe with it (a lane turned to recompute waits for its first
        probe; one that loads needs none). Never raises."""
        lane = self.lane(name)
        idle, in_flight = lane.seconds(chunks), self.queued_chunks(name)
        queued = lane.seconds(chunks + in_flight) if idle is not None else None
        probe_age: float | None = None
        if idle is None and name != HOST:  # host memory is memcpy-fast: never probed
            if in_flight == 0:
                self._probe_since[name] = self._clock()  # this load is the probe
            else:
                self._probe_since.setdefault(name, self._clock())
            probe_age = self._probe_age(name, in_flight)
        recompute_s = self.recompute_s(tokens, shared=shared)
        decision = decide_lane(
            self.verdicts.get(name, Verdict.LOAD),
            load_s=queued,
            idle_load_s=idle,
            recompute_s=recompute_s,
            hysteresis=HYSTERESIS,
            probe_age_s=probe_age,
        )
        self.verdicts[name] = decision.verdict
        if name != HOST:
            self._follow(name, decision.verdict, recompute_s, in_flight)
        return decision

    def _follow(self, name: str, verdict: Verdict, recompute_s: float, in_flight: int) -> None:
        """Lower tier lane ``name``'s probe follows its new ``verdict``: none needed
        while it loads; a part declined adds its ``recompute_s`` to the probe's credit
        (the first probe's cost: one chunk's read behind the ``in_flight`` chunks, as
        the lane model expects it)."""
        probe = self.probes.get(name)
        if probe is None:
            probe = self.probes[name] = LaneProbe()
        if verdict is Verdict.LOAD:
            probe.loads()
            return
        cost = self.lane(name).seconds(PROBE_CHUNKS + in_flight)
        probe.declined(self._clock(), recompute_s, cost or 0.0)

    def offer_probe(self, name: str, request_id: str) -> bool:
        """Whether the part of ``request_id``'s hit on lane ``name`` that :meth:`decide`
        just declined is loaded anyway, its first
        :data:`~kvoffload.core.cost.probing.PROBE_CHUNKS` chunk, as the lane's probe
        (due, or already offered to that request); the offer holds the lane's one
        probe until the request's load is planned or the offer lapses. Never raises."""
        probe = self.probes.get(name)
        return probe is not None and probe.offer(self._clock(), request_id, self._plans)


__all__ = ["HOST", "CostModel", "Decline", "JobTiming", "LaneCosts", "fixed_timing"]
