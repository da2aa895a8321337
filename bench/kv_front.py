"""A minimal KV-aware front for bench/'s fleet benchmark (``fleet_router.py``): routes
each request to the engine Dynamo's indexer credits most, or round-robin.

The score of an engine for a request is what the indexer's ``/query`` answers for the
request's token ids, weighted as Dynamo's router weighs tiers by default: tokens
matched in the engine's own memory (``gpu``) 1.0, tokens matched only in its host
memory (``cpu`` - ``gpu``: ``cpu`` counts both) 0.75; disk and remote tiers score
nothing. The best score wins; ties go to the engine sent the fewest requests so far,
then to the next engine in round-robin order after the last one chosen. A front that
is not KV-aware (or has no indexer) scores every engine 0: plain round-robin; with an
indexer it still asks it, so that its routes can be compared by the credit they had.

:func:`settled` is how the benchmark waits, after each request, until the indexer
credits what that request left behind, as a steady stream of later requests would
find it: the serving engine's memory with the prompt's full blocks, and (where
engines announce what a node share holds) every engine with them in some tier.

State: :class:`Front` owns its counts of requests sent (mutated by :meth:`Front.route`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

Credit = dict[int, dict[str, int]]  # worker -> tier -> matched tokens (the indexer's answer)

GPU_WEIGHT = 1.0
HOST_WEIGHT = 0.75


def score(credit: dict[str, int]) -> float:
    """One engine's score from its ``gpu``/``cpu`` matched tokens."""
    gpu = credit.get("gpu", 0)
    return GPU_WEIGHT * gpu + HOST_WEIGHT * (credit.get("cpu", 0) - gpu)


@dataclass(frozen=True)
class Route:
    """One routing decision: the engine (an index), every engine's score, the
    indexer's answer (None without one) and how long asking it took."""

    engine: int
    scores: tuple[float, ...]
    credit: Credit | None
    query_s: float


class Front:
    """Routes requests over engines ``0 .. len(workers) - 1``, engine ``i`` being worker
    ``workers[i]`` at the indexer (see the module docstring); ``ask`` queries the
    indexer (None: none); ``kv_aware`` False: round-robin whatever it answers."""

    def __init__(
        self,
        workers: list[int],
        ask: Callable[[list[int]], Credit] | None,
        *,
        kv_aware: bool = True,
    ) -> None:
        self.workers = list(workers)
        self.ask = ask
        self.kv_aware = kv_aware
        self.sent = [0] * len(workers)
        self.last = -1

    def route(self, tokens: list[int]) -> Route:
        """Choose the engine for ``tokens`` and count the request as sent to it."""
        began = time.perf_counter()
        credit = self.ask(tokens) if self.ask is not None else None
        query_s = time.perf_counter() - began
        use = credit if self.kv_aware else None
        scores = tuple(score(use.get(w, {})) if use is not None else 0.0 for w in self.workers)
        n = len(self.workers)
        best = min(range(n), key=lambda i: (-scores[i], self.sent[i], (i - self.last - 1) % n))
        self.sent[best] += 1
        self.last = best
        return Route(best, scores, credit, query_s)


def settled(
    ask: Callable[[list[int]], Credit],
    tokens: list[int],
    served: int,
    workers: list[int],
    *,
    block: int,
    everyone: bool,
    within_s: float,
) -> bool:
    """Poll the indexer until it credits worker ``served``'s memory (``gpu``) with
    every full block of ``tokens`` and, with ``everyone``, every worker with them in
    any tier (``disk`` counts all three); False past ``within_s`` seconds."""
    full = len(tokens) // block * block

    def ok(credit: Credit) -> bool:
        if credit[served]["gpu"] < full:
            return False
        return not everyone or all(credit[w]["disk"] >= full for w in workers)

    deadline = time.monotonic() + within_s
    while not ok(ask(tokens)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
