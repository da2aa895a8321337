"""One simulation: a workload through the engine and the real scheduler half.

Wiring (as in production, and as :func:`kvoffload.testing.run.run_schedule` wires
the tests): a host :class:`~kvoffload.core.directory.Directory` (``cpu_bytes`` of
chunk slots, the eviction policy, ``store_threshold``), lower tiers as
:class:`~kvoffload.core.tiering.lower.DirectoryTier` (``tiers/build.py``), the real
:class:`~kvoffload.core.scheduler.OffloadScheduler` with its tier planner, the
simulated worker and the reference engine in its fast mode. With less host memory
than one chunk kvoffload is off (the engine runs alone: the baseline).

Time: a request enters the engine's queue once the simulated clock has reached its
timestamp (and the queue holds fewer than ``max_queue`` requests; later arrivals
wait, in order, in front of it). Each engine step advances the clock by its cost;
when a step computes nothing and no job completes, the clock jumps to the next job
completion or arrival. Deterministic: no wall-clock time and no randomness.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable

from kvoffload.core.directory import Directory, HostDirectory
from kvoffload.core.errors import UsageError
from kvoffload.core.keys import Namespace
from kvoffload.core.scheduler import OffloadScheduler
from kvoffload.core.scheduler_types import SchedulerConfig
from kvoffload.core.tiering.lower import DirectoryTier
from kvoffload.engine.block_pool import BlockPool
from kvoffload.engine.group_tables import NULL_BLOCK, GroupTables
from kvoffload.engine.settings import EngineConfig
from kvoffload.simulate.batching import Admissions
from kvoffload.simulate.content import ContentHasher
from kvoffload.simulate.engine import sim_engine
from kvoffload.simulate.groups import describe
from kvoffload.simulate.report import GroupResult, SimResult, TierResult
from kvoffload.simulate.request import SimRequest, StepMeter
from kvoffload.simulate.settings import SimConfig
from kvoffload.simulate.trace import TraceRequest
from kvoffload.simulate.worker import SimClock, SimWorker
from kvoffload.tiers.build import build_scheduler, directory_tiers

# SimConfig lives in kvoffload.simulate.settings
__all__ = ["STUCK_STEPS", "SimConfig", "Simulation", "run_simulation"]

STUCK_STEPS = 10000


class Simulation:
    """The objects of one run and their wiring (see the module docstring).

    ``host``: a host directory given by the caller (the one tier several replicas
    share, :mod:`kvoffload.simulate.replicas`) instead of one of ``cpu_bytes``;
    ``hasher``: block hashes shared with other replicas (the same content hashes
    alike in every engine). Both None for a run of one engine."""

    def __init__(
        self,
        config: SimConfig,
        host: HostDirectory | None = None,
        hasher: ContentHasher | None = None,
    ) -> None:
        self.config = c = config
        self.clock = SimClock()
        self.hasher = hasher if hasher is not None else ContentHasher(c.block_size)
        self.pool = BlockPool(c.num_blocks, c.block_size)
        self.pool.data = bytearray()  # the null model never reads or writes KV bytes
        # Several KV cache groups (or a window): per-group tables in the shared pool.
        self.tables = GroupTables(self.pool, c.kv_groups) if c.hybrid else None
        engine_config = EngineConfig(
            num_blocks=c.num_blocks,
            block_size=c.block_size,
            token_budget=c.token_budget,
            max_running=c.max_running,
            enable_prefix_caching=c.prefix_caching,
        )
        self.host: HostDirectory | None = None
        self.lower: list[DirectoryTier] = []
        self.scheduler: OffloadScheduler | None = None
        self.worker: SimWorker | None = None
        if host is not None or c.host_slots:
            self.host = (
                host
                if host is not None
                else Directory(c.host_slots, policy=c.eviction, store_threshold=c.store_threshold)
            )
            self.lower = directory_tiers(c.tier_slots, c.eviction)
            admission = c.lower_tier_admission
            self.scheduler = build_scheduler(
                SchedulerConfig(
                    block_size=c.block_size,
                    blocks_per_chunk=c.chunk_tokens // c.block_size,
                    max_deferral_steps=c.max_deferral_steps,
                    max_deferral_seconds=c.max_deferral_seconds,
                    null_block=NULL_BLOCK if self.tables is not None else None,
                    kv_groups=c.kv_groups,
                    direct_tier_loads=c.lower_tier_loads == "direct",
                    load_policy=c.load_policy,  # the engine's decision, learned the same way
                    prefill_tokens_per_s=1.0 / c.cost.prefill_s_per_token,
                ),
                self.host,
                Namespace(model="simulated", layout=self._layout(), dtype="-"),
                self.lower,
                spill_after_hits=0 if admission == "write_through" else int(admission),
                clock=lambda: self.clock.now,
            )
        self.meter = meter = StepMeter()
        if self.scheduler is not None:
            group_of = self.tables.group_of if self.tables is not None else None
            self.worker = SimWorker(
                c.cost, c.chunk_bytes, self.clock, meter, group_of, codecs=c.tier_codecs
            )
        self.admissions = Admissions()
        self.engine = sim_engine(
            engine_config,
            self.scheduler,
            self.worker,
            self.pool,
            meter=meter,
            decode_stride=c.decode_stride,
            admissions=self.admissions,
            tables=self.tables,
        )
        self.result = SimResult(c.settings(), c.cost, c.chunk_bytes)
        if self.tables is not None:
            kinds = c.kv_groups.describe().split(",")
            self.result.groups = GroupResult(kinds, c.num_blocks, c.request_capacity)
        self.arrived: list[tuple[int, float]] = []  # (request index, TTFT)
        self.first_arrival: float | None = None
        self.last_arrival = 0.0
        self.capacity = c.request_capacity  # the longest request (None: any)

    def _layout(self) -> str:
        c = self.config
        layout = f"{c.cost.bytes_per_token}B/token"
        return f"{layout};{describe(c.kv_groups)}" if c.hybrid else layout

    def _make(self, spec: TraceRequest, index: int) -> SimRequest:
        need = spec.prompt_tokens + spec.output
        if self.capacity is not None and need > self.capacity:
            raise UsageError(f"{spec.where}: {self.config.too_large(need)}; raise --engine-tokens")
        if self.first_arrival is None:
            self.first_arrival = spec.t
        self.last_arrival = spec.t
        return SimRequest(f"r{index}", spec, index, self.hasher)

    def run(
        self, requests: Iterable[TraceRequest], progress: Callable[[int], None] | None
    ) -> SimResult:
        started = time.perf_counter()
        engine, clock, meter, worker = self.engine, self.clock, self.meter, self.worker
        source = iter(requests)
        upcoming = next(source, None)
        backlog: deque[SimRequest] = deque()
        index = stuck = 0
        while True:
            while upcoming is not None and upcoming.t <= clock.now:
                backlog.append(self._make(upcoming, index))
                index += 1
                upcoming = next(source, None)
            while backlog and len(engine.waiting) < self.config.max_queue:
                engine.add(backlog.popleft())
            if not (engine.waiting or engine.running or backlog) and engine.idle:
                if upcoming is None:
                    break
                clock.now = max(clock.now, upcoming.t)
                continue
            meter.reset()
            engine.step()
            if worker is None:
                clock.end_step(meter, self.config.cost)
            clock.now = clock.step_end
            self._account(progress)
            if meter.scheduled or (worker is not None and worker.completed_last_step):
                stuck = 0
                continue
            events = [upcoming.t if upcoming is not None else None]
            events.append(worker.next_finish() if worker is not None else None)
            later = [t for t in events if t is not None and t > clock.now]
            if later:
                clock.now = min(later)
            stuck += 1
            if stuck > STUCK_STEPS:
                raise RuntimeError(f"simulation stuck at t={clock.now:.3f}s: {self._state()}")
        self._finish()
        self.result.wall_s = time.perf_counter() - started
        return self.result

    def _account(self, progress: Callable[[int], None] | None) -> None:
        meter, r = self.meter, self.result
        r.computed_prefill_tokens += meter.prefill
        r.decode_tokens += meter.decode
        for req in meter.first_tokens:
            req.first_token_at = self.clock.now
        for req in meter.finished:
            r.requests += 1
            r.prompt_tokens += len(req.prompt)
            r.output_tokens += len(req.output)
            r.engine_hit_tokens += req.first_local
            r.kvoffload_hit_tokens += req.first_external
            if req.first_token_at is not None:
                self.arrived.append((req.index, req.first_token_at - req.arrival))
        if progress is not None and meter.finished:
            progress(len(meter.finished))
        groups = r.groups
        if groups is not None:  # what the engine holds at the end of the step
            e = self.engine
            used = self.pool.num_blocks - self.pool.num_free - 1  # not the null block
            groups.peak_blocks = max(groups.peak_blocks, used)
            held = sum(req.num_computed_tokens for req in e.running)
            groups.peak_context_tokens = max(groups.peak_context_tokens, held)

    def _state(self) -> str:
        e = self.engine
        return (
            f"{len(e.waiting)} waiting, {len(e.running)} running, {self.pool.num_free} free blocks"
        )

    def _finish(self) -> None:
        r, e = self.result, self.engine
        r.readmissions = self.admissions.readmissions
        r.readmission_hit_tokens = self.admissions.readmission_external
        r.preemptions = e.preemptions
        r.engine_steps = e.steps
        r.simulated_s = self.clock.now
        r.flush_stall_s = self.clock.stalled_total_s
        fill_ttfts(r, self.arrived)
        r.trace_span_s = self.last_arrival - (self.first_arrival or 0.0)
        if self.scheduler is None or self.host is None or self.worker is None:
            return
        metrics, chunks = self.scheduler.metrics, self.worker.traffic.chunks
        r.deferrals = metrics.breakdown("deferrals_total", "reason")
        r.deferral_timeouts = metrics.value("deferral_timeouts_total")
        r.declined_tokens = metrics.breakdown("declined_tokens_total", "tier")
        r.admission_refusals = self.host.metrics.value("admission_refusals_total")
        r.lane_busy_s = dict(self.worker.traffic.busy_s)
        r.lane_codec_s = dict(self.worker.traffic.codec_s)
        codecs = self.config.tier_codecs
        r.tiers.append(
            TierResult(
                "host",
                self.host.num_slots,
                codecs["host"],
                written=chunks[("store", "host")],
                read=chunks[("load", "host")],
                evictions=self.host.metrics.value("evictions_total"),
                held_at_end=len(self.host),
                evicted_without_copy=self.host.metrics.value("evicted_without_copy_total")
                if self.lower
                else 0,
            )
        )
        if r.groups is not None:
            traffic = self.worker.traffic.groups
            for g in range(len(r.groups.kinds)):
                r.groups.stored.append(traffic[("store", g)])
                r.groups.loaded.append(traffic[("load", g)])
        for tier in self.lower:
            r.tiers.append(
                TierResult(
                    tier.name,
                    tier.directory.num_slots,
                    codecs[tier.name],
                    written=chunks[("spill", tier.name)],
                    read=chunks[("promote", tier.name)] + chunks[("load", tier.name)],
                    evictions=tier.directory.metrics.value("evictions_total"),
                    held_at_end=len(tier.directory),
                )
            )


def percentile(ordered: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``ordered`` (sorted, not empty), by rank."""
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def fill_ttfts(r: SimResult, arrived: list[tuple[int, float]]) -> None:
    """Set ``r``'s time-to-first-token figures from (request index, TTFT) pairs
    (none: left at 0)."""
    if not arrived:
        return
    ordered = sorted(ttft for _, ttft in arrived)
    r.ttft_mean_s = sum(ordered) / len(ordered)
    r.ttft_p50_s = ordered[len(ordered) // 2]
    r.ttft_p95_s = percentile(ordered, 0.95)
    last = sorted(arrived)[-max(1, len(arrived) // 10) :]
    late = sorted(ttft for _, ttft in last)
    r.late_ttft_p50_s = late[len(late) // 2]


def run_simulation(
    config: SimConfig,
    requests: Iterable[TraceRequest],
    progress: Callable[[int], None] | None = None,
) -> SimResult:
    """Simulate ``requests`` (in timestamp order) under ``config``; ``progress`` is
    called with the number of requests finished since its last call. Raises
    UsageError for a request larger than the engine's KV capacity."""
    return Simulation(config).run(requests, progress)
