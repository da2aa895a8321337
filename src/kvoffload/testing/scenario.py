"""Scenarios for the explorer: a workload plus the engine and tier geometry."""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from kvoffload.core.config.options import default
from kvoffload.engine.settings import StepMode


@dataclass(frozen=True)
class RequestSpec:
    request_id: str
    prompt: tuple[int, ...]
    max_tokens: int
    salt: str | None = None
    arrival_step: int = 0
    abort_step: int | None = None


@dataclass(frozen=True)
class Scenario:
    requests: tuple[RequestSpec, ...]
    mode: StepMode = StepMode.BATCH_QUEUE
    block_size: int = 4
    blocks_per_chunk: int = 1
    num_blocks: int = 16
    token_budget: int = 16
    max_running: int = 4
    num_slots: int = 16
    eviction: str = default("eviction")
    world_size: int = 1
    max_deferral_steps: int = 8  # the bound in steps, busy or idle (logical clock)
    max_hold_steps: int = 3  # a job is reported at most this many steps after it may run
    prefix_caching: bool = True  # the engine's own prefix cache
    reset_steps: tuple[int, ...] = ()  # kvoffload's cache is reset before these steps
    lower_tier_slots: int = 0  # a disk-like tier below host memory (0: none)
    spill_after_hits: int = 0  # its admission: 0 write-through, N after N host hits
    tier_loads: str = default("lower_tier_loads")  # a lower tier's hit: "direct" or "promote"
    options: dict[str, bool] = field(default_factory=dict)  # testing switches

    def without(self, index: int) -> Scenario:
        return replace(self, requests=self.requests[:index] + self.requests[index + 1 :])

    def describe(self) -> str:
        lines = [
            f"mode={self.mode.value} block_size={self.block_size} "
            f"blocks_per_chunk={self.blocks_per_chunk} num_blocks={self.num_blocks} "
            f"token_budget={self.token_budget} max_running={self.max_running} "
            f"num_slots={self.num_slots} eviction={self.eviction} world_size={self.world_size} "
            f"max_deferral_steps={self.max_deferral_steps} prefix_caching={self.prefix_caching} "
            f"reset_steps={list(self.reset_steps)} lower_tier_slots={self.lower_tier_slots} "
            f"spill_after_hits={self.spill_after_hits} tier_loads={self.tier_loads} "
            f"options={self.options}"
        ]
        for r in self.requests:
            extra = f" salt={r.salt!r}" if r.salt else ""
            extra += f" arrives@{r.arrival_step}" if r.arrival_step else ""
            extra += f" aborted@{r.abort_step}" if r.abort_step is not None else ""
            lines.append(
                f"  {r.request_id}: {len(r.prompt)} prompt tokens {list(r.prompt)} "
                f"max_tokens={r.max_tokens}{extra}"
            )
        return "\n".join(lines)


def random_scenario(rng: random.Random, options: dict[str, bool] | None = None) -> Scenario:
    """Small, preemption-prone scenarios: shared prefixes, salts, aborts. With a lower
    tier, the host tier is tiny and arrivals are spread out, so later requests find
    their prefix below host memory and must wait for a promotion."""
    block_size = 4
    blocks_per_chunk = rng.choice((1, 1, 2))
    num_blocks = rng.randint(8, 20)
    lower_tier_slots = rng.choice((0, 0, 4, 8, 16))
    tiered = bool(lower_tier_slots)
    longest = 20 if tiered else 16
    prefixes = [[rng.randrange(3, 50) for _ in range(rng.randint(4, longest))] for _ in range(2)]
    arrivals = (0, 3, 6, 9, 12) if tiered else (0, 0, 1, 2, 4)
    requests = []
    for i in range(rng.randint(2, 5)):
        prompt = list(rng.choice(prefixes)) + [
            rng.randrange(3, 50) for _ in range(rng.randint(0, 10))
        ]
        max_tokens = rng.randint(1, 6)
        while -(-(len(prompt) + max_tokens) // block_size) > num_blocks - 2:
            prompt.pop()
        if not prompt:
            prompt = [7]
        requests.append(
            RequestSpec(
                f"r{i}",
                tuple(prompt),
                max_tokens,
                salt=rng.choice((None, None, None, "tenant-b")),
                arrival_step=rng.choice(arrivals),
                abort_step=rng.randint(1, 12) if rng.random() < 0.15 else None,
            )
        )
    scenario = Scenario(
        requests=tuple(requests),
        mode=rng.choice((StepMode.SYNC, StepMode.BATCH_QUEUE, StepMode.BATCH_QUEUE)),
        block_size=block_size,
        blocks_per_chunk=blocks_per_chunk,
        num_blocks=num_blocks,
        token_budget=rng.choice((8, 12, 16, 32)),
        max_running=rng.randint(2, 4),
        num_slots=rng.choice((2, 3, 4)) if tiered else rng.choice((2, 4, 8, 32)),
        eviction=rng.choice(("lru", "arc", "s3fifo")),
        max_deferral_steps=rng.choice((2, 4, 50)),
        max_hold_steps=rng.choice((1, 2, 3)),
        prefix_caching=rng.random() < (0.4 if tiered else 0.7),
        world_size=rng.choice((1, 1, 1, 2)),
        reset_steps=(rng.randint(2, 10),) if rng.random() < 0.1 else (),
        lower_tier_slots=lower_tier_slots,
        spill_after_hits=rng.choice((0, 0, 1)),
        options=dict(options or {}),
    )
    if not tiered:
        return scenario
    return replace(scenario, tier_loads=rng.choice(("direct", "direct", "promote")))
