"""One simulation: a workload through the engine and the real scheduler half.

Wiring (as in production, and as :func:`kvoffload.testing.run.run_schedule` wires
the tests): a host :class:`~kvoffload.core.directory.Directory` (``cpu_bytes`` of
chunk slots, the eviction policy, ``store_threshold``), lower tiers as
:class:`~kvoffload.core.tiering.DirectoryTier` (disk, then redis), the real
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
from dataclasses import asdict, dataclass, field

from kvoffload.core.config import OffloadConfig
from kvoffload.core.directory import Directory
from kvoffload.core.errors import UsageError
from kvoffload.core.keys import Namespace
from kvoffload.core.scheduler import OffloadScheduler
from kvoffload.core.scheduler_types import SchedulerConfig
from kvoffload.core.tiering import DirectoryTier
from kvoffload.engine.block_pool import BlockPool
from kvoffload.engine.settings import EngineConfig
from kvoffload.simulate.batching import Admissions
from kvoffload.simulate.content import ContentHasher
from kvoffload.simulate.cost import CostModel
from kvoffload.simulate.engine import sim_engine
from kvoffload.simulate.report import SimResult, TierResult
from kvoffload.simulate.request import SimRequest, StepMeter
from kvoffload.simulate.trace import TraceRequest
from kvoffload.simulate.worker import SimClock, SimWorker

_STUCK_STEPS = 10000


@dataclass(frozen=True)
class SimConfig:
    """Everything one simulation needs besides the workload; validated at
    construction (ConfigError for kvoffload options, UsageError for the rest)."""

    cpu_bytes: int
    disk_bytes: int = 0
    redis_bytes: int = 0
    eviction: str = "lru"
    store_threshold: int = 1
    lower_tier_admission: str | int = "write_through"
    engine_tokens: int = 262144
    block_size: int = 64
    chunk_tokens: int = 256
    token_budget: int = 8192
    max_running: int = 128
    decode_stride: int = 128
    max_queue: int = 256
    prefix_caching: bool = True
    max_deferral_steps: int = 500
    max_deferral_seconds: float = 5.0
    cost: CostModel = field(default_factory=CostModel)

    def __post_init__(self) -> None:
        for name in ("block_size", "token_budget", "max_running", "decode_stride", "max_queue"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UsageError(f"--{name.replace('_', '-')}: must be an integer >= 1")
        for name in ("cpu_bytes", "disk_bytes", "redis_bytes"):
            if getattr(self, name) < 0:
                raise UsageError(f"--{name.replace('_', '-')}: must be >= 0")
        if self.engine_tokens < self.block_size:
            raise UsageError(f"--engine-tokens: must hold at least one block ({self.block_size})")
        # kvoffload's own validation of its options (names the key, lists accepted values)
        OffloadConfig(
            cpu_bytes=max(1, self.cpu_bytes),
            chunk_tokens=self.chunk_tokens,
            eviction=self.eviction,
            store_threshold=self.store_threshold,
            lower_tier_admission=self.lower_tier_admission,
            max_deferral_steps=self.max_deferral_steps,
            max_deferral_seconds=self.max_deferral_seconds,
        ).resolve_chunk_tokens(self.block_size)
        if (self.disk_slots or self.redis_slots) and not self.host_slots:
            raise UsageError(
                "disk and redis tiers sit below host memory: --cpu-bytes must hold a chunk"
            )

    @property
    def chunk_bytes(self) -> int:
        return self.chunk_tokens * self.cost.bytes_per_token

    @property
    def host_slots(self) -> int:
        return self.cpu_bytes // self.chunk_bytes

    @property
    def disk_slots(self) -> int:
        return self.disk_bytes // self.chunk_bytes

    @property
    def redis_slots(self) -> int:
        return self.redis_bytes // self.chunk_bytes

    @property
    def num_blocks(self) -> int:
        return self.engine_tokens // self.block_size

    def settings(self) -> dict[str, object]:
        out = asdict(self)
        del out["cost"]
        return out


class _Simulation:
    """The objects of one run and their wiring (see the module docstring)."""

    def __init__(self, config: SimConfig) -> None:
        self.config = c = config
        self.clock = SimClock()
        self.hasher = ContentHasher(c.block_size)
        self.pool = BlockPool(c.num_blocks, c.block_size)
        self.pool.data = bytearray()  # the null model never reads or writes KV bytes
        engine_config = EngineConfig(
            num_blocks=c.num_blocks,
            block_size=c.block_size,
            token_budget=c.token_budget,
            max_running=c.max_running,
            enable_prefix_caching=c.prefix_caching,
        )
        self.host: Directory | None = None
        self.lower: list[DirectoryTier] = []
        self.scheduler: OffloadScheduler | None = None
        self.worker: SimWorker | None = None
        if c.host_slots:
            self.host = Directory(
                c.host_slots, policy=c.eviction, store_threshold=c.store_threshold
            )
            for tier, slots in (("disk", c.disk_slots), ("redis", c.redis_slots)):
                if slots:
                    self.lower.append(DirectoryTier(Directory(slots, tier=tier, policy=c.eviction)))
            admission = c.lower_tier_admission
            self.scheduler = OffloadScheduler(
                SchedulerConfig(
                    block_size=c.block_size,
                    blocks_per_chunk=c.chunk_tokens // c.block_size,
                    max_deferral_steps=c.max_deferral_steps,
                    max_deferral_seconds=c.max_deferral_seconds,
                ),
                self.host,
                Namespace(model="simulated", layout=f"{c.cost.bytes_per_token}B/token", dtype="-"),
                lower_tiers=self.lower,
                spill_after_hits=0 if admission == "write_through" else int(admission),
                clock=lambda: self.clock.now,
            )
        self.meter = meter = StepMeter()
        if self.scheduler is not None:
            self.worker = SimWorker(c.cost, c.chunk_bytes, self.clock, meter)
        self.admissions = Admissions()
        self.engine = sim_engine(
            engine_config,
            self.scheduler,
            self.worker,
            self.pool,
            meter=meter,
            decode_stride=c.decode_stride,
            admissions=self.admissions,
        )
        self.result = SimResult(c.settings(), c.cost, c.chunk_bytes)
        self.ttfts: list[float] = []

    def _make(self, spec: TraceRequest, index: int) -> SimRequest:
        need = spec.prompt_tokens + spec.output
        if -(-need // self.config.block_size) > self.config.num_blocks:
            raise UsageError(
                f"{spec.where}: the request needs {need} tokens of KV, more than the engine "
                f"holds ({self.config.engine_tokens}); raise --engine-tokens"
            )
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
            if stuck > _STUCK_STEPS:
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
                self.ttfts.append(req.first_token_at - req.arrival)
        if progress is not None and meter.finished:
            progress(len(meter.finished))

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
        if self.ttfts:
            ordered = sorted(self.ttfts)
            r.ttft_mean_s = sum(ordered) / len(ordered)
            r.ttft_p50_s = ordered[len(ordered) // 2]
            r.ttft_p95_s = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
        if self.scheduler is None or self.host is None or self.worker is None:
            return
        metrics, chunks = self.scheduler.metrics, self.worker.traffic.chunks
        r.deferrals = metrics.breakdown("deferrals_total", "reason")
        r.deferral_timeouts = metrics.value("deferral_timeouts_total")
        r.admission_refusals = self.host.metrics.value("admission_refusals_total")
        r.lane_busy_s = dict(self.worker.traffic.busy_s)
        r.tiers.append(
            TierResult(
                "host",
                self.host.num_slots,
                written=chunks[("store", "host")],
                read=chunks[("load", "host")],
                evictions=self.host.metrics.value("evictions_total"),
                held_at_end=len(self.host),
            )
        )
        for tier in self.lower:
            r.tiers.append(
                TierResult(
                    tier.name,
                    tier.directory.num_slots,
                    written=chunks[("spill", tier.name)],
                    read=chunks[("promote", tier.name)],
                    evictions=tier.directory.metrics.value("evictions_total"),
                    held_at_end=len(tier.directory),
                )
            )


def run_simulation(
    config: SimConfig,
    requests: Iterable[TraceRequest],
    progress: Callable[[int], None] | None = None,
) -> SimResult:
    """Simulate ``requests`` (in timestamp order) under ``config``; ``progress`` is
    called with the number of requests finished since its last call. Raises
    UsageError for a request larger than the engine's KV capacity."""
    return _Simulation(config).run(requests, progress)
