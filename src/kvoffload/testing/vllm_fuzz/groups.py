"""The KV cache groups a fuzzed engine has, and the engine blocks they need.

Groups (vLLM's hybrid KV cache manager) are drawn from a stream of their own
(:func:`draw_groups`), apart from the rest of a scenario, so a seed that draws one
full-attention group keeps the schedule it had before groups were drawn. More groups
get more engine blocks (:func:`engine_blocks`): every full-attention group as many
as a one-group engine, every window group what vLLM admits a request with. A group
is None (full attention) or a sliding window in tokens. Pure functions of their
arguments.
"""

from __future__ import annotations

import random

BLOCK_SIZE = 16
MAX_BATCHED_TOKENS = 64  # the engine's max_num_batched_tokens
WINDOWS = (32, 32, 64, 64, 16, 40, 100)  # tokens; block multiples or not


def describe_groups(groups: tuple[int | None, ...]) -> str:
    return ",".join("full" if w is None else f"window={w}" for w in groups)


def draw_groups(seed: int) -> tuple[int | None, ...]:
    """The KV cache groups of ``seed``: mostly one full-attention group; else one
    full-attention group among 1-3 window groups, or window groups only (1-2), the
    windows drawn independently (often of different sizes)."""
    rng = random.Random(f"kvoffload-vllm-fuzz:groups:{seed}")
    if rng.random() < 0.65:
        return (None,)
    if rng.random() < 0.35:
        return tuple(rng.choice(WINDOWS) for _ in range(rng.randint(1, 2)))
    groups: list[int | None] = [rng.choice(WINDOWS) for _ in range(rng.randint(1, 3))]
    groups.insert(rng.randint(0, len(groups)), None)
    return tuple(groups)


def window_blocks(window: int) -> int:
    """The blocks vLLM admits a request with in a window group (its window and the
    tokens of two batches in flight, as ``SlidingWindowSpec`` counts them), plus one."""
    return -(-(window - 1 + 2 * MAX_BATCHED_TOKENS) // BLOCK_SIZE) + 1


def engine_blocks(blocks: int, groups: tuple[int | None, ...]) -> int:
    """The engine blocks for ``groups`` when one full-attention group has ``blocks``
    (a request of up to ``blocks - 2`` blocks always fits, alone)."""
    full = sum(w is None for w in groups)
    return blocks * max(1, full) + sum(window_blocks(w) for w in groups if w is not None)
