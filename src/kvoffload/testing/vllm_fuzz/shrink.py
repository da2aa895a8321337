"""Shrinking a failing scenario to a small reproduction.

Greedy: try each simplification (drop a request with its aborts, an abort, a reset,
a weight update, a sleep, a fault; one rank instead of two; no connector beside
kvoffload; store everything) and keep the first that still fails with the same
category of failure; repeat until nothing simpler fails or the budget of runs is
spent.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from kvoffload.testing.vllm_fuzz.runner import Environment, Outcome, run_scenario
from kvoffload.testing.vllm_fuzz.scenario import Scenario


def simpler(scenario: Scenario) -> Iterator[Scenario]:
    for fault in scenario.faults:
        yield replace(scenario, faults=tuple(f for f in scenario.faults if f is not fault))
    for reset in scenario.resets:
        yield replace(scenario, resets=tuple(r for r in scenario.resets if r is not reset))
    for update in scenario.weight_updates:
        yield replace(
            scenario, weight_updates=tuple(u for u in scenario.weight_updates if u is not update)
        )
    for sleep in scenario.sleeps:
        yield replace(scenario, sleeps=tuple(z for z in scenario.sleeps if z is not sleep))
    for abort in scenario.aborts:
        yield replace(scenario, aborts=tuple(a for a in scenario.aborts if a is not abort))
    for request in scenario.requests:
        if len(scenario.requests) > 1:
            yield scenario.without_request(request.request_id)
    for g in range(len(scenario.groups) if len(scenario.groups) > 1 else 0):
        yield replace(scenario, groups=scenario.groups[:g] + scenario.groups[g + 1 :])
    if scenario.world_size > 1:
        yield replace(scenario, world_size=1)
    if scenario.beside is not None:
        yield replace(scenario, beside=None)
    if scenario.store_threshold > 1:
        yield replace(scenario, store_threshold=1)


def shrink(failure: Outcome, env: Environment, budget: int = 200) -> tuple[Outcome, int]:
    """The smallest failing variant found, and how many runs it took."""
    best, runs = failure, 0
    progress = True
    while progress and runs < budget:
        progress = False
        for candidate in simpler(best.scenario):
            if runs >= budget:
                break
            runs += 1
            outcome = run_scenario(candidate, env)
            if outcome.failed and outcome.category == best.category:
                best, progress = outcome, True
                break
    return best, runs
