"""The fuzzer's draws of what changes an engine's weights or memory from outside its
loop: in-place weight updates (decision 0019) and sleeps (decision 0021). Each has a
random stream of its own, so every seed keeps the rest of the schedule it had before
the draw existed."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class WeightUpdate:
    """An RL framework's weight update before ``step``: the weights change in place,
    then vLLM's default ``reset_prefix_cache`` (the connector is not told; with
    ``running``, running requests are preempted first). Done only when the reset
    succeeds (decision 0019)."""

    step: int
    running: bool


@dataclass(frozen=True)
class SleepWake:
    """vLLM's sleep mode before ``step`` (decision 0021): ``sleep(level)`` in abort
    mode (every request aborted, the connector reset of a paused scheduler, the KV
    memory released), then ``wake_up()``; ``weights_changed``: the weights came back
    other than they were."""

    step: int
    level: int
    weights_changed: bool


WEIGHT_UPDATE_SHARE = 0.3
"""Share of seeds whose weights are updated in place while they run."""


def draw_weight_updates(seed: int, horizon: int) -> tuple[WeightUpdate, ...]:
    """In-place weight updates with vLLM's default reset (their own stream: the other
    draws of a seed stay as they were)."""
    rng = random.Random(f"kvoffload-vllm-fuzz-weights:{seed}")
    if rng.random() >= WEIGHT_UPDATE_SHARE:
        return ()
    return tuple(
        sorted(
            (WeightUpdate(rng.randint(1, horizon), rng.random() < 0.6)
             for _ in range(rng.choice((1, 1, 2, 3)))),
            key=lambda u: u.step,
        )
    )  # fmt: skip


SLEEP_SHARE = 0.2
"""Share of seeds whose engine sleeps and wakes while they run."""


def draw_sleeps(seed: int, horizon: int) -> tuple[SleepWake, ...]:
    """Sleeps and wake-ups (their own stream: the other draws of a seed stay)."""
    rng = random.Random(f"kvoffload-vllm-fuzz-sleep:{seed}")
    if rng.random() >= SLEEP_SHARE:
        return ()
    return tuple(
        sorted(
            (SleepWake(rng.randint(1, horizon), rng.choice((1, 2)), rng.random() < 0.3)
             for _ in range(rng.choice((1, 1, 2)))),
            key=lambda z: z.step,
        )
    )  # fmt: skip
