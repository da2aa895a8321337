"""One fuzzed schedule as data: the engine, the requests, the events and the faults.

A :class:`Scenario` is drawn from a seed alone (:func:`random_scenario`), so a seed
names its schedule; it is plain frozen data, so the shrinker can drop requests,
events and faults and run what is left.

KV cache groups are drawn apart (``groups.py``), so a seed that draws one
full-attention group keeps the schedule it had before groups were drawn.
"""

from __future__ import annotations

import enum
import json
import random
from dataclasses import dataclass, field, replace

from kvoffload.core.policies import policy_names
from kvoffload.testing.vllm_fuzz.codecs import NONE, describe_codecs, draw_codecs
from kvoffload.testing.vllm_fuzz.engine_events import (
    SleepWake,
    WeightUpdate,
    draw_sleeps,
    draw_weight_updates,
)
from kvoffload.testing.vllm_fuzz.groups import (
    BLOCK_SIZE,
    describe_groups,
    draw_groups,
    engine_blocks,
)
from kvoffload.testing.vllm_fuzz.sealing import draw_sealing


class Tiers(enum.Enum):
    HOST = "host"
    DISK = "host+disk"
    REDIS = "host+redis"


class FaultKind(enum.Enum):
    FAIL_STORE = "fail_store"  # an engine -> host copy fails
    FAIL_LOAD = "fail_load"  # a host -> engine copy fails (the engine recomputes)
    SLOW_STORE = "slow_store"  # a store finishes some steps later
    SLOW_LOAD = "slow_load"  # a load finishes some steps later
    FAIL_TIER = "fail_tier"  # a spill, promotion or tier load's read fails as a whole
    SLOW_TIER = "slow_tier"  # a spill, promotion or tier load's read is some steps late
    HANG_TIER = "hang_tier"  # a spill or promotion never finishes while requests run
    TORN_DISK = "torn_disk"  # a disk write is torn (reported done, found by the checksum)
    RANK_SKEW = "rank_skew"  # rank 1 finishes a job some steps after rank 0
    REORDER = "reorder"  # reports and ranks come in shuffled order
    REDIS_DOWN = "redis_down"  # the Redis server is killed, then restarted empty
    HUNG_IO = "hung_io"  # a tier read or write hangs inside its job past its deadline
    FORGED = "forged"  # a sealed chunk rewritten in the store, its checksum valid (issue 41)


@dataclass(frozen=True)
class Fault:
    kind: FaultKind
    rate: float = 0.0  # share of jobs it hits
    steps: int = 1  # how many steps late (slow, skew)
    start: int = 0  # REDIS_DOWN: killed at this step ...
    end: int = 0  # ... and restarted at this one
    never: float = 0.0  # HUNG_IO: share of hung calls that return only once requests are done

    def describe(self) -> str:
        if self.kind is FaultKind.REDIS_DOWN:
            return f"{self.kind.value} steps {self.start}..{self.end}"
        if self.kind is FaultKind.HUNG_IO:
            return (
                f"{self.kind.value} rate {self.rate:.2f} up to {self.steps} steps, "
                f"never {self.never:.2f} (deadline {HUNG_IO_DEADLINE_STEPS} steps)"
            )
        return f"{self.kind.value} rate {self.rate:.2f}" + (
            f" up to {self.steps} steps" if self.steps > 1 else ""
        )


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    arrival: int  # the engine step before which it is added
    prompt: tuple[int, ...]
    max_tokens: int
    salt: str | None = None
    prompt_logprobs: bool = False  # vLLM then skips reading the prefix cache
    controls: str | None = None  # kv_transfer_params["kvoffload"], as JSON


@dataclass(frozen=True)
class Reset:
    step: int
    running: bool  # reset_running_requests
    connector: bool  # reset_connector


@dataclass(frozen=True)
class Beside:
    """kvoffload under test as the second child of vLLM's ``MultiConnector``, after a
    loading connector (another kvoffload, standing in for a P/D connector) with
    ``host_chunks`` chunks of host memory that stores after ``store_threshold``
    lookups: it loads whenever it has a hit, into blocks of the engine's choosing, and
    its copies meet the same faults."""

    host_chunks: int
    store_threshold: int


@dataclass(frozen=True)
class Scenario:
    seed: int
    async_scheduling: bool
    num_blocks: int
    blocks_per_chunk: int
    host_chunks: int
    store_threshold: int
    eviction: str
    world_size: int
    tiers: Tiers
    max_num_seqs: int
    max_deferral_steps: int
    max_deferral_seconds: float
    groups: tuple[int | None, ...] = (None,)  # None: full attention; else a window
    lower_chunks: int = 0
    requests: tuple[RequestSpec, ...] = ()
    aborts: tuple[tuple[int, str], ...] = ()  # (step, request id)
    resets: tuple[Reset, ...] = ()
    weight_updates: tuple[WeightUpdate, ...] = ()
    sleeps: tuple[SleepWake, ...] = ()
    faults: tuple[Fault, ...] = field(default_factory=tuple)
    beside: Beside | None = None  # kvoffload beside another loading connector
    lane_cost: float = 0.0  # the lower tier's seconds per chunk loaded (decision 0013)
    codecs: tuple[str, str] = NONE  # host memory's codec, the lower tier's (issue 33)
    sealed: bool = False  # the lower tier's chunks sealed (issue 41, sealing.py)

    def fault(self, kind: FaultKind) -> Fault | None:
        return next((f for f in self.faults if f.kind is kind), None)

    def without_request(self, request_id: str) -> Scenario:
        return replace(
            self,
            requests=tuple(r for r in self.requests if r.request_id != request_id),
            aborts=tuple(a for a in self.aborts if a[1] != request_id),
        )

    def describe(self) -> str:
        lines = [
            f"seed={self.seed} scheduler={'async' if self.async_scheduling else 'sync'} "
            f"blocks={self.num_blocks} chunk={self.blocks_per_chunk} blocks "
            f"host={self.host_chunks} chunks tiers={self.tiers.value}"
            + (f" lower={self.lower_chunks} chunks" if self.lower_chunks else "")
            + f" eviction={self.eviction} store_threshold={self.store_threshold} "
            f"world={self.world_size} max_num_seqs={self.max_num_seqs} "
            f"deferral<={self.max_deferral_steps} steps/{self.max_deferral_seconds} s"
            + (f" groups={describe_groups(self.groups)}" if self.groups != (None,) else "")
            + (f" lane_cost={self.lane_cost:g} s/chunk" if self.lane_cost else "")
            + describe_codecs(self.codecs)
            + (" sealed" if self.sealed else "")
            + (
                f" beside=MultiConnector(other kvoffload: host={self.beside.host_chunks} "
                f"chunks, store_threshold={self.beside.store_threshold})"
                if self.beside is not None
                else ""
            )
        ]
        for r in self.requests:
            extra = (
                (f" salt={r.salt}" if r.salt else "")
                + (" prompt_logprobs" if r.prompt_logprobs else "")
                + (f" kvoffload={r.controls}" if r.controls else "")
            )
            lines.append(
                f"  {r.request_id}@{r.arrival}: {len(r.prompt)} tokens "
                f"{list(r.prompt[:6])}..., max_tokens={r.max_tokens}{extra}"
            )
        lines += [f"  abort {rid} before step {step}" for step, rid in self.aborts]
        lines += [
            f"  reset before step {r.step} (running={r.running}, connector={r.connector})"
            for r in self.resets
        ]
        lines += [
            f"  weights updated before step {u.step} (running={u.running})"
            for u in self.weight_updates
        ]
        lines += [
            f"  sleep (level {z.level}) and wake before step {z.step} "
            f"(weights changed={z.weights_changed})"
            for z in self.sleeps
        ]
        lines += [f"  fault {f.describe()}" for f in self.faults]
        return "\n".join(lines)


HUNG_IO_DEADLINE_STEPS = 10
"""``tier_io_timeout_ms`` in engine steps of a schedule with hung tier I/O."""


def random_scenario(seed: int, async_scheduling: bool, redis: bool = True) -> Scenario:
    """The schedule of ``seed`` (``redis``: whether a Redis tier may be drawn)."""
    rng = random.Random(f"kvoffload-vllm-fuzz:{seed}")
    k = rng.choice((1, 1, 2, 3, 4))
    num_blocks = rng.randint(12, 28)
    tiers = rng.choice((Tiers.HOST, Tiers.HOST, Tiers.DISK, Tiers.REDIS))
    if tiers is Tiers.REDIS and not redis:
        tiers = Tiers.DISK
    max_request = (num_blocks - 2) * BLOCK_SIZE
    groups = draw_groups(seed)
    scenario = Scenario(
        seed=seed,
        async_scheduling=async_scheduling,
        num_blocks=engine_blocks(num_blocks, groups),
        blocks_per_chunk=k,
        host_chunks=rng.randint(2, 24 if tiers is Tiers.HOST else 8),
        store_threshold=rng.choice((1, 1, 1, 2, 3)),
        eviction=rng.choice(policy_names()),
        world_size=rng.choice((1, 1, 2)),
        tiers=tiers,
        max_num_seqs=rng.randint(2, 6),
        max_deferral_steps=rng.randint(2, 40),
        max_deferral_seconds=rng.choice((0.1, 0.3, 1.0, 2.0)),  # 5-100 steps of 20 ms
        groups=_kept_draw(rng, groups),
        lower_chunks=rng.randint(8, 64) if tiers is Tiers.DISK else 0,
    )
    more = (len(groups) + 1) // 2  # several groups store more chunks per token
    scenario = replace(
        scenario, host_chunks=scenario.host_chunks * more, lower_chunks=scenario.lower_chunks * more
    )
    revisit = rng.random() < (0.5 if tiers is not Tiers.HOST else 0.2)
    requests = _revisits(rng, max_request) if revisit else _requests(rng, max_request)
    last = max(r.arrival for r in requests)
    aborts = tuple(
        (rng.randint(0, last + 30), rng.choice(requests).request_id)
        for _ in range(rng.choice((0, 0, 1, 2, 3)))
    )
    resets = tuple(  # mostly the engine's own cache: later requests are kvoffload's
        Reset(rng.randint(1, last + 30), rng.random() < 0.75, rng.random() < 0.25)
        for _ in range(rng.choice((0, 1, 2, 3, 4, 6)))
    )
    scenario = replace(
        scenario,
        requests=requests,
        aborts=aborts,
        resets=resets,
        faults=_faults(rng, scenario, last + 40),
        beside=draw_beside(seed),
        lane_cost=draw_lane_cost(seed),
        weight_updates=draw_weight_updates(seed, last + 30),
        sleeps=draw_sleeps(seed, last + 30),
        codecs=draw_codecs(seed),
    )
    sealed, forged = draw_sealing(seed) if scenario.tiers is not Tiers.HOST else (False, 0.0)
    if sealed:
        forgery = (Fault(FaultKind.FORGED, rate=forged),) if forged else ()
        scenario = replace(scenario, sealed=True, faults=scenario.faults + forgery)
    return scenario


def draw_lane_cost(seed: int) -> float:
    """The lower tier's fixed cost per chunk loaded (its own stream: the other draws of
    a seed stay as they were). Mostly free; else slow enough that the cost model
    declines its hits once it measured one, or near a recomputation's cost (a chunk of
    16-64 tokens at the harness's 64 tokens per 20 ms step: 5-20 ms), where the queue
    flips the decision."""
    rng = random.Random(f"kvoffload-vllm-fuzz-lane:{seed}")
    return rng.choice((0.0, 0.0, 0.0, 0.5, 0.004, 0.01))


BESIDE_SHARE = 0.3
"""Share of seeds that run kvoffload beside another loading connector."""


def draw_beside(seed: int) -> Beside | None:
    """The MultiConnector draw, from a stream of its own (every seed keeps the rest of
    the schedule it had before this draw existed)."""
    rng = random.Random(f"kvoffload-vllm-fuzz-beside:{seed}")
    if rng.random() >= BESIDE_SHARE:
        return None
    return Beside(host_chunks=rng.randint(4, 32), store_threshold=rng.choice((1, 1, 1, 2)))


def _kept_draw(rng: random.Random, groups: tuple[int | None, ...]) -> tuple[int | None, ...]:
    """``groups``, after the draw that once chose a sliding window (then refused at
    start): kept, so every seed that ran before keeps its schedule."""
    rng.random()
    return groups


def _requests(rng: random.Random, max_request: int) -> tuple[RequestSpec, ...]:
    systems = [
        [rng.randrange(3, 1000) for _ in range(rng.randint(0, 120))]
        for _ in range(rng.randint(1, 3))
    ]
    salts = rng.choice(((None,), (None,), (None, "tenant-b"), ("tenant-a", "tenant-b")))
    out: list[RequestSpec] = []
    histories: list[tuple[list[int], str | None]] = []
    step = 0
    for i in range(rng.randint(3, 16)):
        step += rng.choice((0, 0, 1, 2, 5, 12, 25))
        if histories and rng.random() < 0.55:  # the next turn of a conversation
            history, salt = rng.choice(histories)
        else:
            history, salt = list(rng.choice(systems)), rng.choice(salts)
        if rng.random() < 0.1:
            history = []  # a prompt shorter than one chunk, with nothing shared
        turn = [rng.randrange(3, 1000) for _ in range(rng.randint(1, 60))]
        max_tokens = rng.choice((1, 2, 8, 16, 33, 64))
        if out and rng.random() < 0.2:  # the same prompt again (a retry, a shared document)
            again = rng.choice(out)
            history, salt, turn = list(again.prompt), again.salt, []
        prompt = (history + turn)[: max_request - max_tokens]
        logprobs = rng.random() < 0.1
        controls = _controls(rng) if rng.random() < 0.15 else None
        out.append(RequestSpec(f"r{i}", step, tuple(prompt), max_tokens, salt, logprobs, controls))
        answer = [rng.randrange(3, 1000) for _ in range(max_tokens)]
        histories.append((prompt + answer, salt))
    return tuple(out)


def _controls(rng: random.Random) -> str:
    """Per-request controls, a bad value among them (served without offloading)."""
    choice = rng.choice(
        (
            {"store": False},
            {"load": False},
            {"max_load_tokens": rng.randrange(0, 200)},
            {"max_store_tokens": rng.randrange(0, 200)},
            {"load_tiers": ["host"]},
            {"load_tiers": ["host", "disk"]},
            {"max_load_tokens": "all"},
        )
    )
    return json.dumps(choice)


def _revisits(rng: random.Random, max_request: int) -> tuple[RequestSpec, ...]:
    """Documents read in rounds: each round evicts the last from the engine and from
    host memory, so later rounds are served from below (or recomputed)."""
    docs = [
        [rng.randrange(3, 1000) for _ in range(rng.randint(20, max(21, max_request // 2)))]
        for _ in range(rng.randint(3, 6))
    ]
    out = []
    step = 0
    for round_ in range(rng.randint(2, 3)):
        for d, doc in enumerate(docs):
            step += rng.choice((0, 1, 3, 8))
            question = [rng.randrange(3, 1000) for _ in range(rng.randint(1, 20))]
            max_tokens = rng.choice((1, 4, 16))
            prompt = (doc + question)[: max_request - max_tokens]
            out.append(RequestSpec(f"d{d}q{round_}", step, tuple(prompt), max_tokens))
        step += rng.choice((5, 20))
    return tuple(out)


def _faults(rng: random.Random, scenario: Scenario, horizon: int) -> tuple[Fault, ...]:
    faults: list[Fault] = []
    candidates = [
        FaultKind.FAIL_STORE,
        FaultKind.FAIL_LOAD,
        FaultKind.SLOW_STORE,
        FaultKind.SLOW_LOAD,
        FaultKind.REORDER,
    ]
    if scenario.world_size > 1:
        candidates.append(FaultKind.RANK_SKEW)
    if scenario.tiers is not Tiers.HOST:
        candidates += [FaultKind.FAIL_TIER, FaultKind.SLOW_TIER, FaultKind.HANG_TIER]
    if scenario.tiers is Tiers.DISK:
        candidates.append(FaultKind.TORN_DISK)
    for kind in rng.sample(candidates, rng.randint(0, min(4, len(candidates)))):
        faults.append(Fault(kind, rate=rng.choice((0.05, 0.2, 0.5, 1.0)), steps=rng.randint(1, 6)))
    if scenario.tiers is Tiers.REDIS and rng.random() < 0.3:
        start = rng.randint(1, horizon)
        faults.append(Fault(FaultKind.REDIS_DOWN, start=start, end=start + rng.randint(1, 20)))
    hung = _hung_io(scenario)
    return tuple(faults) + ((hung,) if hung is not None else ())


def _hung_io(scenario: Scenario) -> Fault | None:
    """Hung tier I/O, drawn apart (every seed drawn before keeps its schedule): calls
    that hang from a few steps (some return before their deadline) to many past it,
    and some until the requests are done."""
    rng = random.Random(f"kvoffload-vllm-fuzz:hung-io:{scenario.seed}")
    if scenario.tiers is Tiers.HOST or rng.random() >= 0.35:
        return None
    return Fault(
        FaultKind.HUNG_IO,
        rate=rng.choice((0.1, 0.3, 0.6)),
        steps=rng.choice((5, 20, 40)),
        never=rng.choice((0.0, 0.25)),
    )
