"""Replay a multi-turn chat workload through the host directory: hit rate per policy.

Each request looks up its prompt's chunk keys, counts the readable prefix as hits,
touches them, then stores the prompt's remaining full chunks (as a serving engine
with kvoffload would after prefill). Capacity is given as a fraction of the
workload's working set. Pure bookkeeping: no model, no bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.core.directory import Directory
from kvoffload.core.keys import Namespace, keys_from_tokens
from kvoffload.core.policies import policy_names
from kvoffload.workload.chat import ChatWorkload

_NS = Namespace(model="demo", layout="none", dtype="none")


@dataclass(frozen=True)
class ReplayResult:
    policy: str
    slots: int
    chunks_looked_up: int
    chunks_hit: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        return self.chunks_hit / max(1, self.chunks_looked_up)


def replay(workload: ChatWorkload, policy: str, slots: int, chunk_tokens: int) -> ReplayResult:
    directory = Directory(slots, policy=policy)
    looked_up = hit = 0
    for request in workload.requests():
        keys = keys_from_tokens(_NS, request.prompt, chunk_tokens, chunk_tokens)
        readable = directory.readable_prefix(keys)
        directory.touch(keys[:readable])
        directory.record_lookups(keys)
        looked_up += len(keys)
        hit += readable
        prepared = directory.prepare_store(keys[readable:])
        directory.complete_store(prepared.keys, success=True)
    return ReplayResult(policy, slots, looked_up, hit, directory.stats.evictions)


def run(fractions: tuple[float, ...] = (0.1, 0.25, 0.5, 1.0), chunk_tokens: int = 32) -> str:
    """Replay the default workload for every policy and capacity; return the table."""
    workload = ChatWorkload(users=32, turns=8, system_tokens=512, user_tokens=(32, 256))
    working_set = workload.working_set_tokens() // chunk_tokens
    labels = [f"{f:.0%} ({int(working_set * f)} chunks)" for f in fractions]
    header = "policy  " + "".join(f"{label:>22}" for label in labels)
    lines = [
        f"kvoffload directory demo: {workload.users} users x {workload.turns} turns, "
        f"shared {workload.system_tokens}-token system prompt, chunk = {chunk_tokens} tokens",
        f"working set: {working_set} chunks; cells: chunk hit rate (evictions)",
        header,
    ]
    for policy in policy_names():
        cells = []
        for fraction in fractions:
            result = replay(workload, policy, max(1, int(working_set * fraction)), chunk_tokens)
            cells.append(f"{result.hit_rate:>14.1%} ({result.evictions:>5})")
        lines.append(f"{policy:8}" + "".join(cells))
    return "\n".join(lines)
