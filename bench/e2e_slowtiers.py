"""The "slowtiers" workload of ``bench/e2e.py``: real slow tiers, load or recompute
(decision 0013, issue 22) on a real engine.

Workload: the "tiers" workload's capped chat (``bench/e2e_tiers.py``: 16 users x 6
turns on the demo model, every engine at 4 running requests, a small KV cache, the
host tier at 10% of the working set over one lower tier; ``--quick``: the tiny
model, 2 turns). Each lower tier is put behind a slower link:

- ``redis``: a private redis-server (``e2e_tiers.start_redis``, FLUSHALL before every
  run) reached through ``bench/throttle_proxy.py``, a loopback TCP proxy in a child
  process: ``rate`` bytes/s each way (shared by kvoffload's connections) plus
  ``--tier-latency-ms`` on every request; a fresh proxy per run, closed after it.
- ``disk``: the disk tier (a fresh directory per run) with kvoffload's disk store
  reads and writes paced in the engine process (:func:`throttled_disk` wraps
  ``DiskTierStore.read_many`` / ``write_many`` for the run): each call waits the
  latency, then its bytes at ``rate`` from one bucket shared by reads and writes
  (one device), then does its I/O.

Speeds (``--speeds``, default 0.1,0.3,1,3,10) are multiples of the engine's recompute
speed, measured first in the same run (:func:`calibrate`): a no-offload engine
prefills :data:`CALIBRATION_BATCHES` batches of 4 fresh prompts of the workload's
median prompt length (one output token); prefill tokens/s (median) x KV bytes per
token = the bytes/s at which loading a prefix takes as long as recomputing it.
Speed ``s`` is a link of ``s`` x that rate (the latency comes on top).

Configurations, per round (runs interleaved, the policies' order alternating by
round, a fresh in-process engine each): ``no-offload`` (the small engine without a
connector; the reference for outputs) once; for each tier and speed kvoffload with
``load_policy: always`` (every hit loaded, the behaviour before 0013) and
``load_policy: cost`` (the default). Reported: mean TTFT (medians over rounds), the
ratios cost / min(no offload, always) (target <= 1.05 at every speed) and cost /
always where the tier is fast (speeds >= :data:`FAST`: target <= 1.02), each the
median over rounds of the same round's ratio; kvoffload's counters (tier loads,
declined tokens, failed chunks, I/O timeouts, the per-job read rate it measured);
outputs must equal no offload's (a difference, or a kvoffload run that fails, makes
the exit status non-zero; timing targets only print FAIL). The report and the targets
are in ``bench/e2e_slowtiers_report.py``.

Duration: each run is a fresh engine over the whole workload; the default sweep (2 tiers
x 5 speeds x 2 policies + no offload = 21 runs a round, 3 rounds) took an estimated
45-90 minutes on a 2-core CPU machine (demo model: about 30 s per fast run, more for
``always`` at the slowest speeds, where tier jobs run into ``tier_io_timeout_ms``).
"""

from __future__ import annotations

import random
import shutil
import statistics
import time
import traceback
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from e2e_metrics import Counts, run_counted
from e2e_tiers import MAX_RUNNING, TierSetup, start_redis
from kvoffload.demos.tiny_model import PRESETS
from kvoffload.demos.vllm_runner import EngineSpec, RunResult, open_engine, run_batches, warm_up
from kvoffload.demos.vllm_runner import turn_batches as _turns
from throttle_proxy import SharedBucket, ThrottleProxy

SPEEDS = (0.1, 0.3, 1.0, 3.0, 10.0)
TIERS = ("redis", "disk")
POLICIES = ("always", "cost")
REFERENCE = "no-offload"
FAST = 3.0  # speeds from here up count as a fast tier (cost / always target)
LATENCY_MS = 0.5  # default per-request latency of a slowed tier
CALIBRATION_BATCHES = 3
RUN_LIFETIME_S = 1800.0  # a proxy outliving this closes by itself (a run never takes that)
MB = 1e6


def config_name(tier: str, speed: float, policy: str) -> str:
    return f"{tier}@{speed:g}x/{policy}"


@dataclass(frozen=True)
class SlowSetup:
    tiers: TierSetup
    speeds: tuple[float, ...] = SPEEDS
    tier_names: tuple[str, ...] = TIERS
    latency_s: float = LATENCY_MS / 1000

    def configs(self) -> list[str]:
        return [
            config_name(t, s, p) for t in self.tier_names for s in self.speeds for p in POLICIES
        ]


@dataclass(frozen=True)
class _Prompt:
    prompt: tuple[int, ...]
    output_tokens: int = 1


@dataclass(frozen=True)
class Recompute:
    """The engine's measured prefill speed and what it is worth in bytes/s of KV."""

    tokens_per_s: float
    token_bytes: int
    prompt_tokens: int  # per calibration prompt

    @property
    def bytes_per_s(self) -> float:
        return self.tokens_per_s * self.token_bytes


def calibrate(setup: SlowSetup) -> Recompute:
    """Prefill tokens/s of the small no-offload engine: the median over
    :data:`CALIBRATION_BATCHES` batches of :data:`MAX_RUNNING` fresh random prompts of
    the workload's median prompt length (no prefix shared with anything)."""
    ts = setup.tiers
    length = int(statistics.median(len(r.prompt) for r in ts.workload.requests()))
    vocab = PRESETS[ts.preset].vocab_size
    rng = random.Random(20260422)
    rates = []
    with open_engine(ts.engine(REFERENCE, 0, None)) as llm:
        warm_up(llm)
        for _ in range(CALIBRATION_BATCHES):
            batch = [
                _Prompt(tuple(rng.randrange(4, vocab) for _ in range(length)))
                for _ in range(MAX_RUNNING)
            ]
            result = run_batches(llm, [batch])
            rates.append(result.prompt_tokens / result.wall_s)
    return Recompute(statistics.median(rates), ts.token_bytes, length)


@contextmanager
def throttled_disk(rate: float, latency_s: float) -> Iterator[None]:
    """kvoffload's disk store reads and writes, in this process, paced to ``rate``
    bytes/s (one bucket for both: one device) plus ``latency_s`` per call; restored
    when the block ends."""
    from kvoffload.tiers.disk_store import DiskTierStore

    bucket = SharedBucket(rate)
    read_many, write_many = DiskTierStore.read_many, DiskTierStore.write_many

    def pace(nbytes: int) -> None:
        time.sleep(latency_s + bucket.reserve(nbytes))

    def slow_read(self: Any, keys: Any, slots: Any, outs: Any, groups: Any = ()) -> Any:
        pace(sum(memoryview(o).nbytes for o in outs))
        return read_many(self, keys, slots, outs, groups)

    def slow_write(self: Any, items: Any, slots: Any, groups: Any = ()) -> Any:
        pace(sum(memoryview(p).nbytes for _, p in items))
        return write_many(self, items, slots, groups)

    DiskTierStore.read_many = slow_read  # type: ignore[method-assign]
    DiskTierStore.write_many = slow_write  # type: ignore[method-assign]
    try:
        yield
    finally:
        DiskTierStore.read_many = read_many  # type: ignore[method-assign]
        DiskTierStore.write_many = write_many  # type: ignore[method-assign]


def with_policy(spec: EngineSpec, policy: str, **options: Any) -> EngineSpec:
    """``spec`` with kvoffload's ``load_policy`` (and any other ``options``) set."""
    transfer = dict(spec.kv_transfer_config or {})
    transfer["kv_connector_extra_config"] = {
        **transfer["kv_connector_extra_config"],
        "load_policy": policy,
        **options,
    }
    return replace(spec, kv_transfer_config=transfer)


@dataclass
class SlowResults:
    configs: tuple[str, ...]
    recompute: Recompute | None = None
    runs: dict[str, list[RunResult]] = field(default_factory=dict)
    counts: dict[str, list[Counts]] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Run:
    """One configuration of a round: ``tier`` None is no offload."""

    config: str
    tier: str | None = None
    speed: float = 0.0
    policy: str = ""


def _run(
    setup: SlowSetup, run: Run, rnd: int, rate: float, server: Any
) -> tuple[RunResult, Counts | None]:
    ts, batches = setup.tiers, _turns(setup.tiers.workload.requests())
    tier, policy = run.tier, run.policy
    if tier is None:
        return run_counted(ts.engine(REFERENCE, rnd, None), batches)
    with ExitStack() as stack:
        if tier == "redis":
            if server is None:
                raise RuntimeError("no redis-server")
            admin = server.client()
            admin.flushall()  # every run starts cold
            admin.close()
            proxy = ThrottleProxy(server.port, rate, setup.latency_s, RUN_LIFETIME_S)
            stack.enter_context(proxy)
            spec = ts.engine("host10+redis", rnd, f"redis://127.0.0.1:{proxy.port}/0")
        else:
            stack.enter_context(throttled_disk(rate, setup.latency_s))
            spec = ts.engine("host10+disk", rnd, None)
        try:
            return run_counted(with_policy(spec, policy), batches)
        finally:
            shutil.rmtree(ts.root / f"disk-{rnd}", ignore_errors=True)


def round_order(setup: SlowSetup, rnd: int) -> list[Run]:
    """This round's runs in order: no offload, then every tier and speed, the two
    policies' order alternating by round."""
    order = [Run(REFERENCE)]
    policies = POLICIES if rnd % 2 == 0 else POLICIES[::-1]
    for tier in setup.tier_names:
        for speed in setup.speeds:
            order += [Run(config_name(tier, speed, p), tier, speed, p) for p in policies]
    return order


def measure(setup: SlowSetup) -> SlowResults:
    """Calibrate, then ``runs`` rounds of every configuration."""
    configs = (REFERENCE, *setup.configs())
    res = SlowResults(configs, None, {c: [] for c in configs}, {c: [] for c in configs})
    started = time.perf_counter()
    res.recompute = calibrate(setup)
    print(
        f"  slowtiers: recompute {res.recompute.tokens_per_s:.0f} tokens/s = "
        f"{res.recompute.bytes_per_s / MB:.1f} MB/s of KV "
        f"({time.perf_counter() - started:.0f} s)",
        flush=True,
    )
    server = None
    try:
        if "redis" in setup.tier_names:
            try:
                server = start_redis(setup.tiers)
            except Exception as exc:
                for c in configs:
                    if c.startswith("redis@"):
                        res.failed[c] = f"redis-server: {type(exc).__name__}: {exc}"
        runs = setup.tiers.runs
        for rnd in range(runs):
            for run in round_order(setup, rnd):
                config = run.config
                if config in res.failed:
                    continue
                start = time.perf_counter()
                try:
                    rate = run.speed * res.recompute.bytes_per_s
                    result, counts = _run(setup, run, rnd, rate, server)
                except Exception as exc:
                    traceback.print_exc()
                    reason = " ".join(f"{type(exc).__name__}: {exc}".split())
                    res.failed[config] = f"failed: {reason[:300]}"
                    print(f"  slowtiers run {rnd + 1}/{runs} {config}: {res.failed[config]}")
                    continue
                res.runs[config].append(result)
                if counts is not None:
                    res.counts[config].append(counts)
                took = time.perf_counter() - start
                print(
                    f"  slowtiers run {rnd + 1}/{runs} {config}: {took:.0f} s, mean TTFT "
                    f"{result.mean_ttft_s:.3f} s",
                    flush=True,
                )
    finally:
        if server is not None:
            server.kill()
    return res


def parse_speeds(text: str) -> tuple[float, ...]:
    """``"0.1,1,10"`` -> (0.1, 1.0, 10.0); each > 0."""
    speeds = tuple(float(s) for s in text.split(",") if s.strip())
    if not speeds or any(not s > 0 for s in speeds):
        raise ValueError(f"expected speeds > 0, got {text!r}")
    return speeds


def parse_tiers(text: str) -> tuple[str, ...]:
    tiers = tuple(t.strip() for t in text.split(",") if t.strip())
    if not tiers or set(tiers) - set(TIERS):
        raise ValueError(f"expected a subset of {','.join(TIERS)}, got {text!r}")
    return tiers
