"""Run one scenario on vLLM's real scheduler and judge it.

The harness checks every step (see ``vllm_harness/harness.py``). At the end of a
run: every request finished, each one not aborted produced exactly its reference
tokens, and nothing is left anywhere (requests, jobs, pins, slots, engine blocks).
Any exception out of vLLM's or kvoffload's calls is a failure too: in a real engine
it would have killed the engine.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvoffload.core.cost import LaneCosts
from kvoffload.core.keys import ChunkKey
from kvoffload.sealing.layout import SEAL_BYTES
from kvoffload.testing.redis_server import RedisServer
from kvoffload.testing.vllm_fuzz.codecs import codec_options
from kvoffload.testing.vllm_fuzz.faults import FaultPolicy, chance
from kvoffload.testing.vllm_fuzz.groups import BLOCK_SIZE, MAX_BATCHED_TOKENS
from kvoffload.testing.vllm_fuzz.scenario import (
    HUNG_IO_DEADLINE_STEPS,
    FaultKind,
    Scenario,
    Tiers,
)
from kvoffload.testing.vllm_fuzz.sealing import forge_sealed_writes, seal_options
from kvoffload.testing.vllm_harness import HarnessSpec, HarnessViolation, TornWrites, VllmHarness
from kvoffload.testing.vllm_harness.checks import failure_message
from kvoffload.testing.vllm_harness.harness import SECONDS_PER_STEP
from kvoffload.testing.vllm_harness.spec import HEAD_SIZE, HEADS, LAYERS
from kvoffload.tiers.disk import slot_bytes
from kvoffload.tiers.disk_store import DiskTierStore
from kvoffload.transfer.tier_worker import TierWorker

BLOCK_BYTES = len(LAYERS) * HEADS * BLOCK_SIZE * 2 * HEAD_SIZE * 4  # one block, one group's layers
MAX_IDLE_STEPS = 3000  # steps after the last event before a run counts as stuck


@dataclass
class Outcome:
    scenario: Scenario
    status: str  # "passed" | "failed"
    message: str = ""
    trace: list[str] = field(default_factory=list)
    stats: Counter[str] = field(default_factory=Counter)
    slept_away: set[str] = field(default_factory=set)  # requests a sleep aborted

    @property
    def failed(self) -> bool:
        return self.status == "failed"

    @property
    def category(self) -> str:
        """The kind of failure, without ids and numbers (shrinking keeps it)."""
        first = self.message.splitlines()[0] if self.message else ""
        first = re.sub(r"'[^']*'", "'_'", first)
        return re.sub(r"\d+", "N", first)[:90]


class Environment:
    """What runs share: the model directory, a scratch root, a Redis server."""

    def __init__(self, model_path: Path) -> None:
        self.model_path = model_path
        self.root = Path(tempfile.mkdtemp(prefix="kvoffload-fuzz-"))
        self.redis_available = shutil.which("redis-server") is not None
        self._redis: RedisServer | None = None

    def redis(self) -> RedisServer:
        if self._redis is None:
            self._redis = RedisServer(self.root / "redis").start()
        if self._redis.proc is None:
            self._redis.start()
        return self._redis

    def close(self) -> None:
        if self._redis is not None:
            self._redis.kill()
        shutil.rmtree(self.root, ignore_errors=True)


def _seed_lanes(harness: VllmHarness) -> None:
    """A drawn lane cost is known from the start, as a start-up probe would measure it:
    every tier hit of the seed meets the measured decision (lanes without a drawn cost
    stay unmeasured, so their first tier load is the probe)."""
    for unit in harness.units:
        for name, lane in harness.spec.lane_costs.items():
            unit.side.scheduler.cost.lane(name).observe(1, 0, lane.latency_s + lane.s_per_chunk)


def harness_spec(scenario: Scenario, env: Environment, workdir: Path) -> HarnessSpec:
    chunk_bytes = BLOCK_BYTES * scenario.blocks_per_chunk
    world = scenario.world_size
    extra: dict[str, Any] = {
        "chunk_tokens": BLOCK_SIZE * scenario.blocks_per_chunk,
        "store_threshold": scenario.store_threshold,
        "eviction": scenario.eviction,
        "max_deferral_steps": scenario.max_deferral_steps,
        "max_deferral_seconds": scenario.max_deferral_seconds,
        "tier_threads": 2,
    }
    if scenario.tiers is Tiers.DISK:
        extra["disk_path"] = str(workdir / "disk")
        extra["disk_bytes"] = scenario.lower_chunks * slot_bytes(chunk_bytes) * world
    if scenario.fault(FaultKind.HUNG_IO) is not None:
        extra["tier_threads"] = 1  # one ordered tier lane: a hung call holds what follows
        extra["tier_io_timeout_ms"] = round(HUNG_IO_DEADLINE_STEPS * SECONDS_PER_STEP * 1000)
    if scenario.tiers is Tiers.REDIS:
        server = env.redis()
        server.client().flushall()
        extra["redis_url"] = server.url
        extra["redis_timeout_ms"] = 200
    beside = None
    if scenario.beside is not None:
        beside = {
            "cpu_bytes": scenario.beside.host_chunks * chunk_bytes * world,
            "chunk_tokens": extra["chunk_tokens"],
            "store_threshold": scenario.beside.store_threshold,
        }
    tier = {Tiers.DISK: "disk", Tiers.REDIS: "redis"}.get(scenario.tiers)
    extra.update(codec_options(scenario.codecs, tier))
    if scenario.sealed:
        extra.update(seal_options(tier, workdir))
        if tier == "disk":  # room for the seal in each slot: the same chunks as unsealed
            sealed_slot = slot_bytes(chunk_bytes + SEAL_BYTES)
            extra["disk_bytes"] = scenario.lower_chunks * sealed_slot * world
    costs = {tier: LaneCosts(0.0, scenario.lane_cost)} if tier and scenario.lane_cost else {}
    if costs:
        extra["load_policy"] = "cost"  # the drawn lane cost decides load or recompute
    return HarnessSpec(
        lane_costs=costs,
        beside=beside,
        async_scheduling=scenario.async_scheduling,
        num_blocks=scenario.num_blocks,
        block_size=BLOCK_SIZE,
        world_size=world,
        groups=scenario.groups,
        max_num_seqs=scenario.max_num_seqs,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        cpu_bytes=scenario.host_chunks * chunk_bytes * world,
        extra=extra,
    )


def run_scenario(scenario: Scenario, env: Environment) -> Outcome:
    workdir = Path(tempfile.mkdtemp(prefix=f"seed{scenario.seed}-", dir=env.root))
    outcome = Outcome(scenario, "passed")
    harness: VllmHarness | None = None
    try:
        harness = VllmHarness(env.model_path, harness_spec(scenario, env, workdir))
        _seed_lanes(harness)
        _drive(scenario, harness, env, outcome)
    except Exception as exc:
        outcome.status = "failed"
        outcome.message = failure_message(exc)
    finally:
        if harness is not None:
            outcome.trace = harness.trace
            _record_stats(harness, outcome)
            harness.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return outcome


def _drive(scenario: Scenario, h: VllmHarness, env: Environment, outcome: Outcome) -> None:
    policy = FaultPolicy(scenario)
    policy.hangs = h.hangs
    h.policy = policy
    _tear_disk_writes(scenario, h)
    forged = scenario.fault(FaultKind.FORGED)
    if forged is not None:
        lanes = [
            (e.rank, e.under_test.tiers.inner if e.under_test.tiers else None) for e in h.ranks
        ]
        rate = forged.rate
        assert forge_sealed_writes(lanes, lambda r, k: chance(scenario.seed, "forged", k, r) < rate)
    down = scenario.fault(FaultKind.REDIS_DOWN)
    last_event = max(
        [r.arrival for r in scenario.requests]
        + [a[0] for a in scenario.aborts]
        + [r.step for r in scenario.resets]
        + [u.step for u in scenario.weight_updates]
        + [z.step for z in scenario.sleeps]
        + ([down.end] if down is not None else [])
    )
    arrived: set[str] = set()
    step = 0
    while True:
        _fire_events(scenario, h, env, step, arrived=arrived, outcome=outcome)
        if step > last_event and not h.scheduler.has_unfinished_requests():
            if not policy.draining:
                h.release_hangs()  # the calls hung "never": they return now
            policy.draining = True
            if not h.busy():
                break
        if step > last_event + MAX_IDLE_STEPS:
            raise HarnessViolation(f"still busy {MAX_IDLE_STEPS} steps after the last event")
        h.step()
        step += 1
    outcome.stats.update(policy.injected)
    outcome.stats["steps"] = step
    _check_outputs(scenario, h, arrived, outcome)
    h.quiescent()


def _fire_events(
    scenario: Scenario,
    h: VllmHarness,
    env: Environment,
    step: int,
    *,
    arrived: set[str],
    outcome: Outcome,
) -> None:
    for spec in scenario.requests:
        if spec.arrival == step:
            h.add_request(
                spec.request_id,
                list(spec.prompt),
                spec.max_tokens,
                spec.salt,
                prompt_logprobs=1 if spec.prompt_logprobs else None,
                kv_transfer_params=(
                    {"kvoffload": json.loads(spec.controls)} if spec.controls else None
                ),
            )
            if spec.controls:
                outcome.stats["request_controls"] += 1
            arrived.add(spec.request_id)
    for when, request_id in scenario.aborts:
        request = h.scheduler.requests.get(request_id)
        if when == step and request is not None and not request.is_finished():
            outcome.stats[f"abort_{request.status.name.lower()}"] += 1
            h.abort(request_id)
    for reset in scenario.resets:
        if reset.step == step:
            try:
                done = h.reset_prefix_cache(reset.running, reset.connector)
            except RuntimeError as exc:  # vLLM refuses while a load holds blocks
                if "Failed to reset KV cache" not in str(exc):
                    raise
                done = False
            outcome.stats["resets_done" if done else "resets_refused"] += 1
    for update in scenario.weight_updates:
        if update.step == step:
            done = h.update_weights(update.running)
            outcome.stats["weight_updates_done" if done else "weight_updates_refused"] += 1
    for sleep in scenario.sleeps:
        if sleep.step == step:
            outcome.slept_away |= set(h.sleep_engine(sleep.level))
            h.wake_engine(sleep.weights_changed)
            outcome.stats["sleeps"] += 1
            outcome.stats["sleeps_weights_changed"] += sleep.weights_changed
    down = scenario.fault(FaultKind.REDIS_DOWN)
    if down is not None and scenario.tiers is Tiers.REDIS:
        if step == down.start:
            env.redis().kill()
            outcome.stats["redis_killed"] += 1
        elif step == down.end:
            env.redis()  # restarted, empty


def _tear_disk_writes(scenario: Scenario, h: VllmHarness) -> None:
    fault = scenario.fault(FaultKind.TORN_DISK)
    if fault is None:
        return
    for entry in h.ranks:
        tiers = entry.under_test.tiers
        lane = tiers.inner if tiers is not None else None
        if isinstance(lane, TierWorker) and isinstance(lane.stores.get("disk"), DiskTierStore):
            disk = lane.stores["disk"]
            assert isinstance(disk, DiskTierStore)
            lane.stores["disk"] = TornWrites(disk, _torn(scenario.seed, entry.rank, fault.rate))


def _torn(seed: int, rank: int, rate: float) -> Callable[[ChunkKey], bool]:
    return lambda key: chance(seed, "torn", key, rank) < rate


def _check_outputs(scenario: Scenario, h: VllmHarness, arrived: set[str], outcome: Outcome) -> None:
    aborted = {rid for _, rid in scenario.aborts} | outcome.slept_away
    for spec in scenario.requests:
        if spec.request_id not in arrived:
            continue
        if spec.request_id in h.scheduler.requests:
            raise HarnessViolation(f"request {spec.request_id!r} never finished")
        if spec.request_id in aborted:
            continue
        got = h.output_tokens(spec.request_id)
        want = h.model.reference_output(spec.request_id, list(spec.prompt), spec.max_tokens)
        if got != want:
            raise HarnessViolation(
                f"request {spec.request_id!r} produced {got[:8]}..., reference {want[:8]}..."
            )
        outcome.stats["requests_checked"] += 1


def _record_stats(h: VllmHarness, outcome: Outcome) -> None:
    half = h.scheduler_half
    s, m = half.stats, half.metrics
    outcome.stats.update(
        preemptions=m.value("preemptions_total"),
        loads=s.loads,
        loads_checked=h.loads_checked,
        stores=s.stores,
        flushes=m.value("flushes_total"),
        deferrals=sum(m.breakdown("deferrals_total", "reason").values()),
        deferral_timeouts=m.value("deferral_timeouts_total"),
        load_failures=s.load_failures,
        store_failures=s.store_failures,
        connector_resets=m.value("resets_total"),
        weights_changes=m.value("weights_changes_total"),
        fenced_loads=m.value("fenced_jobs_total", direction="load"),
        fenced_stores=m.value("fenced_jobs_total", direction="store"),
        paused_resets=m.value("paused_resets_total"),
    )
    for unit in h.beside:
        other = unit.side.scheduler
        outcome.stats["multi_connector_schedules"] += 1
        outcome.stats["beside_loads"] += other.stats.loads
        outcome.stats["beside_load_failures"] += other.stats.load_failures
        outcome.stats["beside_stores"] += other.stats.stores
    outcome.stats["sealed_schedules"] += outcome.scenario.sealed
    groups = outcome.scenario.groups
    if len(groups) > 1:
        outcome.stats["multi_group_schedules"] += 1
    if any(w is not None for w in groups):
        outcome.stats["window_schedules"] += 1
        outcome.stats["window_loads_checked"] += h.loads_checked
    for tier in half.tiers.tiers.values():
        t = tier.metrics
        moved = t.breakdown("transferred_chunks_total", "direction")
        errors = t.breakdown("integrity_errors_total", "reason")
        found = t.value("hit_tokens_total") // half.config.chunk_tokens  # chunks found
        outcome.stats[f"{tier.name}_spilled"] += moved.get("spill", 0)
        outcome.stats[f"{tier.name}_promoted"] += moved.get("promote", 0)
        outcome.stats[f"{tier.name}_tier_loaded"] += moved.get("load", 0)
        failed = t.breakdown("failed_chunks_total", "direction")
        outcome.stats[f"{tier.name}_tier_load_failed"] += failed.get("load", 0)
        outcome.stats[f"{tier.name}_found"] += found
        outcome.stats[f"{tier.name}_lookups"] += t.value("lookups_total")
        outcome.stats[f"{tier.name}_integrity_errors"] += sum(errors.values())
        outcome.stats["seal_integrity_errors"] += errors.get("seal", 0)
        timeouts = t.breakdown("tier_io_timeouts_total", "direction")
        outcome.stats["tier_io_timeouts"] += sum(timeouts.values())
        declined = half.metrics.breakdown("hits_declined_total", "reason", tier=tier.name)
        for reason, n in declined.items():
            outcome.stats[f"declined_{reason}"] += n
