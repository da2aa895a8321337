"""The ``shared-host`` deployment shape: several engines over one node-shared host tier.

A :class:`SharedScenario` is drawn from a seed alone (:func:`shared_scenario`): the
number of engines (2-3), the share's size, system prompts that requests on different
engines begin with (so cross-engine hits happen), the interleaving (which engine takes
the next engine-loop step, and whether that step's copies complete or stay in flight),
engine kills (some restarted) and node-process kills; for about half the seeds, a
disk tier below the share that the engines share too (through a node process of its
own, decision 0017), small enough that chunks leave the host share and come back
from disk, and whose node process may be killed (its chunks are recovered from the
slabs); and, drawn apart too, share-lifecycle faults under the live engines, and vLLM's KV
events on for half the seeds (every engine's announcements of what the shares hold
checked after every step, ``vllm_harness/announce_watch.py``):
``kvoffload share stop`` then ``remove`` (which must refuse while engines are
attached), and the share root's per-user directory deleted wholesale (systemd's
``RemoveIPC``) with its node processes alive or killed first. :func:`run_shared` runs it on a
:class:`~kvoffload.testing.vllm_harness.fleet.SharedFleet` and judges it: every
engine's checks at every step (cross-engine loads included), each request of an
engine that was not killed produced its reference tokens, and nothing is left stored
or pinned anywhere at the end. Its summary counts cross-engine loads, kills and
recoveries. The default fuzz run adds this shape for :data:`SHARED_HOST_RATE` of the
seeds (drawn apart, so every other schedule of a seed is unchanged);
``--shape shared-host`` runs it alone.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from kvoffload.share.client import ShareDirectory
from kvoffload.testing.vllm_fuzz.groups import BLOCK_SIZE, MAX_BATCHED_TOKENS
from kvoffload.testing.vllm_harness import HarnessSpec, HarnessViolation
from kvoffload.testing.vllm_harness.checks import failure_message
from kvoffload.testing.vllm_harness.fleet import SharedFleet
from kvoffload.testing.vllm_harness.harness import VllmHarness
from kvoffload.testing.vllm_harness.share_faults import stop_share, wipe_share
from kvoffload.testing.vllm_harness.spec import HEAD_SIZE, HEADS, LAYERS
from kvoffload.tiers.disk import slot_bytes

BLOCK_BYTES = len(LAYERS) * HEADS * BLOCK_SIZE * 2 * HEAD_SIZE * 4
SHARED_HOST_RATE = 0.125
"""Share of seeds whose default fuzz run also runs the shared-host shape."""
DRAIN_STEPS = 2000  # engine-loop rounds after the last drawn step before a run is stuck
FAULTS = (0, 0, 1, 1, 2)
"""How many share stops (and, apart, share wipes) a schedule draws, uniformly."""


@dataclass(frozen=True)
class SharedRequest:
    request_id: str
    engine: int
    prompt: tuple[int, ...]
    max_tokens: int
    arrival: int  # the fleet step it arrives at


@dataclass(frozen=True)
class SharedScenario:
    seed: int
    async_scheduling: bool
    engines: int
    host_chunks: int  # the share's size
    num_blocks: int
    requests: tuple[SharedRequest, ...]
    order: tuple[tuple[int, bool], ...]  # (engine stepped, its copies complete) per step
    kills: tuple[tuple[int, int, bool], ...]  # (step, engine, restarted at once)
    node_kills: tuple[int, ...]  # steps the node process is SIGKILLed at
    world_size: int = 1  # tensor-parallel ranks of each engine (a slab per rank)
    disk_chunks: int = 0  # the shared disk tier's size (0: none)
    disk_node_kills: tuple[int, ...] = ()  # steps its node process is SIGKILLed at
    share_stops: tuple[int, ...] = ()  # steps of `share stop` + a refused `share remove`
    share_wipes: tuple[tuple[int, bool], ...] = ()  # (step, node processes killed first)
    kv_events: bool = False  # vLLM's KV events on: every engine's announcements checked

    def describe(self) -> str:
        return (
            f"seed {self.seed} ({'async' if self.async_scheduling else 'sync'}) shared-host: "
            f"{self.engines} engines of {self.world_size} ranks, {self.host_chunks} chunks "
            f"shared, {self.num_blocks} "
            f"blocks each, {len(self.requests)} requests over {len(self.order)} steps, "
            f"engine kills {list(self.kills)}, node kills {list(self.node_kills)}"
            + (
                f", shared disk of {self.disk_chunks} chunks, its node killed at "
                f"{list(self.disk_node_kills)}"
                if self.disk_chunks
                else ""
            )
            + (f", share stops at {list(self.share_stops)}" if self.share_stops else "")
            + (
                f", share wipes (step, killed first) {list(self.share_wipes)}"
                if self.share_wipes
                else ""
            )
        )


def draws_shared_host(seed: int) -> bool:
    """Whether the default run adds the shared-host shape for ``seed``."""
    return random.Random(f"kvoffload-vllm-fuzz-shared-host:{seed}").random() < SHARED_HOST_RATE


def shared_scenario(seed: int, async_scheduling: bool) -> SharedScenario:
    rng = random.Random(f"kvoffload-vllm-fuzz-shared-host-scenario:{seed}:{async_scheduling}")
    engines = rng.choice((2, 2, 3))
    horizon = rng.randint(40, 120)
    prefixes = [
        [rng.randint(3, 999) for _ in range(rng.randint(1, 4) * BLOCK_SIZE + rng.randint(0, 15))]
        for _ in range(rng.randint(1, 3))
    ]
    requests = []
    for n in range(rng.randint(4, 14)):
        head = rng.choice(prefixes) if rng.random() < 0.8 else []
        tail = [rng.randint(3, 999) for _ in range(rng.randint(1, 40))]
        engine, max_tokens = rng.randrange(engines), rng.randint(1, 6)
        arrival = rng.randint(0, horizon * 2 // 3)
        requests.append(SharedRequest(f"r{n}", engine, tuple(head + tail), max_tokens, arrival))
    hold = rng.choice((0.0, 0.2, 0.5))
    order = tuple((rng.randrange(engines), rng.random() >= hold) for _ in range(horizon))
    kills = tuple(
        sorted(
            (rng.randrange(1, horizon), rng.randrange(engines), rng.random() < 0.6)
            for _ in range(rng.choice((0, 1, 1, 2)))
        )
    )
    node_kills = (rng.randrange(1, horizon),) if rng.random() < 0.4 else ()
    host_chunks, num_blocks = rng.randint(6, 40), rng.choice((24, 32, 48))
    # Drawn apart: the draws above (the scenarios without a disk) stay as they were.
    disk = random.Random(f"kvoffload-vllm-fuzz-shared-disk:{seed}:{async_scheduling}")
    disk_chunks = disk.randint(8, 64) if disk.random() < 0.5 else 0
    disk_node_kills = (disk.randrange(1, horizon),) if disk_chunks and disk.random() < 0.4 else ()
    if disk_chunks:  # a host share too small for the prefixes: they come back from disk
        host_chunks = disk.randint(2, 6)
        for n in range(len(requests), len(requests) + disk.randint(4, 10)):
            tail = [disk.randint(3, 999) for _ in range(disk.randint(1, 40))]
            engine, arrival = disk.randrange(engines), disk.randint(0, horizon * 2 // 3)
            prompt = tuple(disk.choice(prefixes) + tail)
            requests.append(SharedRequest(f"r{n}", engine, prompt, disk.randint(1, 6), arrival))
    # Drawn apart as well: every draw above stays as it was.
    life = random.Random(f"kvoffload-vllm-fuzz-share-lifecycle:{seed}:{async_scheduling}")
    share_stops = tuple(sorted(life.randrange(1, horizon) for _ in range(life.choice(FAULTS))))
    share_wipes = tuple(
        sorted(
            (life.randrange(1, horizon), life.random() < 0.5) for _ in range(life.choice(FAULTS))
        )
    )
    events = random.Random(f"kvoffload-vllm-fuzz-share-events:{seed}:{async_scheduling}")
    return SharedScenario(
        seed, async_scheduling, engines, host_chunks, num_blocks,
        tuple(sorted(requests, key=lambda r: r.arrival)), order, kills, node_kills,
        world_size=rng.choice((1, 1, 2)), disk_chunks=disk_chunks,
        disk_node_kills=disk_node_kills, share_stops=share_stops, share_wipes=share_wipes,
        kv_events=events.random() < 0.5,
    )  # fmt: skip


@dataclass
class SharedOutcome:
    scenario: SharedScenario
    status: str = "passed"  # "passed" | "failed"
    message: str = ""
    stats: Counter[str] = field(default_factory=Counter)

    @property
    def failed(self) -> bool:
        return self.status == "failed"

    def report(self) -> str:
        sc = self.scenario
        sched = "async" if sc.async_scheduling else "sync"
        return (
            f"FAILED {sc.describe()}\n  rerun: python -m kvoffload.testing.vllm_fuzz --shape "
            f"shared-host --seeds 1 --start {sc.seed} --scheduler {sched}\n{self.message}"
        )


def shared_spec(scenario: SharedScenario) -> HarnessSpec:
    extra: dict[str, object] = {"chunk_tokens": BLOCK_SIZE}
    if scenario.disk_chunks:  # the fleet places it (disk_path) in its own directory
        disk_bytes = scenario.disk_chunks * slot_bytes(BLOCK_BYTES) * scenario.world_size
        extra["disk_bytes"] = disk_bytes
    return HarnessSpec(
        async_scheduling=scenario.async_scheduling,
        num_blocks=scenario.num_blocks,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        world_size=scenario.world_size,
        cpu_bytes=scenario.host_chunks * BLOCK_BYTES * scenario.world_size,
        extra=extra,
        kv_events=scenario.kv_events,
    )


def run_shared(scenario: SharedScenario, model_path: Path) -> SharedOutcome:
    outcome = SharedOutcome(scenario)
    fleet: SharedFleet | None = None
    try:
        fleet = SharedFleet(model_path, shared_spec(scenario), scenario.engines)
        _drive(scenario, fleet, outcome)
    except Exception as exc:
        outcome.status = "failed"
        outcome.message = failure_message(exc)
    finally:
        if fleet is not None:
            outcome.stats.update(fleet.stats)
            outcome.stats["shared_loads_checked"] += fleet.loads_checked
            outcome.stats["shared_host_schedules"] += 1
            outcome.stats["shared_disk_schedules"] += bool(scenario.disk_chunks)
            outcome.stats["slab_remaps"] += fleet.slab_remaps
            outcome.stats["shared_announcement_checks"] += fleet.announcements_checked
            fleet.close()
    return outcome


def _stuck(index: int, h: VllmHarness) -> str:
    """What a busy engine waits for (a stuck schedule's report)."""
    half = h.scheduler_half
    phases = {s.request_id: s.phase.name for s in half.requests}
    links = {}
    for name, directory in (
        ("host", half.directory),
        ("disk", getattr(half.tiers.tier("disk"), "directory", None)),
    ):
        if isinstance(directory, ShareDirectory):
            link, counts = directory.link, directory.share_counts()
            links[name] = f"connected={link.connected} {dict(link.stats)} {counts}"
    queued = {t: len(q) for t, q in getattr(half.tiers, "_queues", {}).items()}
    return (
        f"engine {index}: vLLM waiting {len(h.scheduler.waiting)} running "
        f"{len(h.scheduler.running)}, kvoffload jobs in flight "
        f"{[(j.kind.value, j.job_id, j.request_id) for j in half.jobs_in_flight()]}, queued "
        f"below host {half.tiers.has_queued()} {queued}, quarantine {bool(half.moves.quarantine)}, "
        f"plan pending {half.builder.has_pending()}, phases {phases}, links {links}"
    )


def _drive(scenario: SharedScenario, fleet: SharedFleet, outcome: SharedOutcome) -> None:
    pending = list(scenario.requests)
    placed: dict[str, int] = {}  # request -> the engine incarnation it was added to
    incarnation = [0] * scenario.engines
    for t, (engine, complete) in enumerate(scenario.order):
        while pending and pending[0].arrival <= t:
            req = pending.pop(0)
            if fleet.alive(req.engine):
                fleet.engine(req.engine).add_request(
                    req.request_id, list(req.prompt), req.max_tokens
                )
                placed[req.request_id] = incarnation[req.engine]
        for step, victim, restart in scenario.kills:
            if step == t and fleet.alive(victim):
                fleet.kill(victim)
                incarnation[victim] += 1
                if restart:
                    fleet.restart(victim)
        if t in scenario.node_kills:
            fleet.kill_node()
        if t in scenario.disk_node_kills:
            fleet.kill_disk_node()
        for _ in range(scenario.share_stops.count(t)):
            stop_share(fleet)
        for step, kill_first in scenario.share_wipes:
            if step == t:
                wipe_share(fleet, kill_first)
        if fleet.alive(engine) and fleet.engine(engine).busy():
            fleet.step(engine, complete)
    for _ in range(DRAIN_STEPS):
        busy = [i for i in range(scenario.engines) if fleet.alive(i) and fleet.engine(i).busy()]
        if not busy:
            break
        for i in busy:
            fleet.step(i)
    else:
        raise HarnessViolation(
            f"engines still busy {DRAIN_STEPS} rounds after the last step: "
            + "; ".join(_stuck(i, fleet.engine(i)) for i in busy)
        )
    for req in scenario.requests:
        if req.request_id not in placed or not fleet.alive(req.engine):
            continue
        if placed[req.request_id] != incarnation[req.engine]:
            continue  # its engine was killed meanwhile
        h = fleet.engine(req.engine)
        got = h.output_tokens(req.request_id)
        want = h.model.reference_output(req.request_id, list(req.prompt), req.max_tokens)
        if got != want:
            raise HarnessViolation(
                f"request {req.request_id!r} produced {got[:8]}..., reference {want[:8]}..."
            )
        outcome.stats["shared_requests_checked"] += 1
    fleet.quiescent()
    for h in fleet.live():
        half = h.scheduler_half
        outcome.stats["shared_loads"] += half.stats.loads
        outcome.stats["shared_stores"] += half.stats.stores
        outcome.stats["shared_load_failures"] += half.stats.load_failures
        disk = half.tiers.tier("disk")
        if disk is not None:
            moved = disk.metrics.breakdown("transferred_chunks_total", "direction")
            outcome.stats["shared_disk_spilled"] += moved.get("spill", 0)
            outcome.stats["shared_disk_read"] += moved.get("load", 0) + moved.get("promote", 0)
