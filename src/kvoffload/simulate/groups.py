"""The simulated engine's KV cache groups: ``--kv-groups``, block costs, capacity.

``--kv-groups`` lists the engine's KV cache groups in order, comma-separated:
``full`` (full attention), ``window=TOKENS`` (a sliding window of TOKENS tokens, the
new one included), and ``NxGROUP`` for N equal groups. vLLM's hybrid KV cache manager
gives every group the same number of layers, so a Gemma-3-style model (five window
layers to one full-attention layer, window 1024) is ``full,5xwindow=1024``; a
Mistral-7B-v0.1-style model (every layer a 4096 window) is ``window=4096``.

The engine's KV memory is ``--engine-tokens`` tokens of the whole model's KV; with
``G`` groups each block holds ``1/G`` of the layers, so the same memory is ``G``
times as many blocks, shared by the groups (one is the null block). A full group
costs a block per ``block_size`` tokens of a request, a window group at most about
``(window + tokens computed in one step) / block_size + 1`` (it frees the rest).
Pure functions; parsing raises UsageError naming the option.
"""

from __future__ import annotations

import re

from kvoffload.core.errors import ConfigError, UsageError
from kvoffload.core.kv_groups import KVGroup, KVGroups

_PART = re.compile(r"^(?:(\d+)x)?(full|window=(-?\d+))$")
_HELP = "expected full, window=TOKENS or NxGROUP, comma-separated (e.g. full,5xwindow=1024)"


def parse_kv_groups(text: str, option: str = "--kv-groups") -> KVGroups:
    """``text`` as KV cache groups (see the module docstring)."""
    groups: list[KVGroup] = []
    for part in (p.strip() for p in text.split(",")):
        match = _PART.match(part)
        if match is None:
            raise UsageError(f"{option}: {part!r} is not a KV cache group; {_HELP}")
        count = int(match.group(1)) if match.group(1) is not None else 1
        if count < 1:
            raise UsageError(f"{option}: {part!r}: the count must be >= 1")
        window = int(match.group(3)) if match.group(3) is not None else None
        try:
            group = KVGroup(window)
        except ConfigError:
            raise UsageError(
                f"{option}: {part!r}: a window must be a positive token count"
            ) from None
        groups += [group] * count
    if len(groups) > 255:
        raise UsageError(f"{option}: at most 255 KV cache groups, got {len(groups)}")
    return KVGroups(tuple(groups))


def describe(groups: KVGroups) -> str:
    """``groups`` in ``--kv-groups`` syntax, runs of equal groups as ``NxGROUP``."""
    parts: list[str] = []
    names = groups.describe().split(",")
    i = 0
    while i < len(names):
        j = i
        while j < len(names) and names[j] == names[i]:
            j += 1
        parts.append(names[i] if j - i == 1 else f"{j - i}x{names[i]}")
        i = j
    return ",".join(parts)


def request_blocks(groups: KVGroups, tokens: int, block_size: int, step_tokens: int) -> int:
    """The most blocks a request of ``tokens`` tokens holds at once, computing at
    most ``step_tokens`` per step (an upper bound for window groups)."""
    blocks = -(-tokens // block_size)
    total = 0
    for group in groups.groups:
        if group.window is None:
            total += blocks
        else:
            live = (group.window - 1 + min(step_tokens, tokens)) // block_size + 2
            total += min(blocks, live)
    return total


def request_capacity(
    groups: KVGroups, num_blocks: int, block_size: int, step_tokens: int
) -> int | None:
    """The longest request (tokens) whose blocks fit in ``num_blocks``; None when any
    length fits (no full-attention group, and the windows fit)."""
    if request_blocks(groups, num_blocks * block_size + 1, block_size, step_tokens) <= num_blocks:
        return None
    lo, hi = 0, num_blocks * block_size + 1  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if request_blocks(groups, mid, block_size, step_tokens) <= num_blocks:
            lo = mid
        else:
            hi = mid
    return lo
