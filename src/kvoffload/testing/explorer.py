"""The interleaving explorer: many schedules, every check, minimal reproductions.

Two modes:

- **random**: seeded scenarios (shared prefixes, a block pool small enough to force
  preemption, aborts, salts) under random completion decisions (held, reordered,
  failed). Schedule ``i`` of seed ``s`` is reproducible from ``(s, i)`` alone.
- **exhaustive**: every sequence of :class:`Choice` decisions at the first ``depth``
  branch points of one scenario (stateless search: each sequence is a fresh run;
  a run covers all its all-default continuations, so no sequence runs twice).

A failing schedule is shrunk (decisions reset to the default one by one, requests
removed, aborts dropped) while it keeps failing with the same category of
violation, and printed as a minimal reproduction with a step-by-step trace.

Usage: ``python -m kvoffload.testing.explorer --random 10000 --seed 1`` or
``--exhaustive``; add ``--disable-deferral`` to watch it find the race the
deferral prevents.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvoffload.engine.settings import StepMode
from kvoffload.testing.policies import Choice, Decision, random_chooser
from kvoffload.testing.run import Outcome, run_schedule
from kvoffload.testing.scenario import RequestSpec, Scenario, random_scenario


@dataclass(frozen=True)
class Failure:
    scenario: Scenario
    decisions: tuple[Decision, ...]
    outcome: Outcome
    found_after: int  # schedules run before this one was found
    origin: str  # how to find it again


@dataclass(frozen=True)
class Report:
    schedules: int
    seconds: float
    failure: Failure | None

    @property
    def per_second(self) -> float:
        return self.schedules / max(self.seconds, 1e-9)


def explore_random(
    count: int, seed: int = 0, options: dict[str, bool] | None = None, stop_at_first: bool = True
) -> Report:
    """Run ``count`` random schedules; stop at the first violation."""
    start = time.perf_counter()
    for i in range(count):
        rng = random.Random(f"{seed}:{i}")
        scenario = random_scenario(rng, options)
        outcome = run_schedule(scenario, chooser=random_chooser(rng))
        if outcome.violation and stop_at_first:
            failure = Failure(
                scenario, tuple(outcome.decisions), outcome, i, f"random seed={seed} index={i}"
            )
            return Report(i + 1, time.perf_counter() - start, failure)
    return Report(count, time.perf_counter() - start, None)


def explore_exhaustive(
    scenario: Scenario,
    depth: int = 8,
    choices: Sequence[Choice] = (Choice.ALL, Choice.NONE, Choice.OLDEST),
) -> Report:
    """Every decision sequence over ``choices`` at the first ``depth`` branch points
    (``choices[0]`` is the default continuation)."""
    start = time.perf_counter()
    default, others = choices[0], tuple(choices[1:])
    stack: list[tuple[Decision, ...]] = [()]
    runs = 0
    while stack:
        prefix = stack.pop()
        outcome = run_schedule(scenario, prefix)
        runs += 1
        if outcome.violation:
            failure = Failure(scenario, prefix, outcome, runs - 1, f"exhaustive {prefix}")
            return Report(runs, time.perf_counter() - start, failure)
        horizon = min(depth, outcome.branch_points)
        for position in range(len(prefix), horizon):
            for choice in others:
                stack.append(prefix + (default,) * (position - len(prefix)) + (choice,))
    return Report(runs, time.perf_counter() - start, None)


def shrink(failure: Failure, budget: int = 400) -> Failure:
    """A smaller schedule failing with the same category of violation."""
    category = failure.outcome.category
    best = failure
    runs = 0

    def fails(scenario: Scenario, decisions: tuple[Decision, ...]) -> Outcome | None:
        nonlocal runs
        runs += 1
        outcome = run_schedule(scenario, decisions)
        return outcome if outcome.category == category else None

    changed = True
    while changed and runs < budget:
        changed = False
        decisions = tuple(best.outcome.decisions[: best.outcome.branch_points])
        candidates: list[tuple[Scenario, tuple[Decision, ...]]] = []
        for i in range(len(best.scenario.requests)):
            candidates.append((best.scenario.without(i), decisions))
        if best.scenario.reset_steps:
            candidates.append((replace(best.scenario, reset_steps=()), decisions))
        for i, spec in enumerate(best.scenario.requests):
            if spec.abort_step is not None:
                reqs = list(best.scenario.requests)
                reqs[i] = replace(spec, abort_step=None)
                candidates.append((replace(best.scenario, requests=tuple(reqs)), decisions))
            if spec.max_tokens > 1:
                reqs = list(best.scenario.requests)
                reqs[i] = replace(spec, max_tokens=spec.max_tokens - 1)
                candidates.append((replace(best.scenario, requests=tuple(reqs)), decisions))
        for i, decision in enumerate(decisions):
            if isinstance(decision, str) and set(decision) != {"C"}:
                simpler = (*decisions[:i], "C" * len(decision), *decisions[i + 1 :])
                candidates.append((best.scenario, simpler))
        for scenario, candidate in candidates:
            if runs >= budget:
                break
            outcome = fails(scenario, candidate)
            if outcome is not None:
                best = Failure(scenario, candidate, outcome, best.found_after, best.origin)
                changed = True
                break
    final = run_schedule(best.scenario, best.decisions, trace=True)
    return Failure(best.scenario, tuple(final.decisions), final, best.found_after, best.origin)


def format_failure(failure: Failure) -> str:
    outcome = failure.outcome
    decisions = [
        f"step {step}: {codes}"
        for step, codes in zip(outcome.branch_steps, outcome.decisions, strict=True)
        if set(codes) != {"C"}
    ]
    return "\n".join(
        [
            f"VIOLATION ({outcome.category}): {outcome.violation}",
            f"found after {failure.found_after} schedules ({failure.origin})",
            "scenario:",
            failure.scenario.describe(),
            "completion decisions other than 'report everything' "
            "(per runnable job, oldest first; C report, F fail, H hold):",
            "  " + ("; ".join(decisions) or "none"),
            "trace:",
            *outcome.trace,
        ]
    )


def seed_race_scenario(
    options: dict[str, bool] | None = None, mode: StepMode = StepMode.BATCH_QUEUE
) -> Scenario:
    """Two requests sharing a prefix, blocks for barely one of them, no engine prefix
    cache: the second is preempted while its store is in flight and can be
    re-admitted before that store is acknowledged, with part of its prefix readable
    in kvoffload. The window of the upstream race (a shrunk random find). The
    deferral bound is one step, so waiting for a pending chunk ends quickly too."""
    prefix = (34, 28, 30, 49, 25, 12, 35, 34, 23, 46, 29, 44)
    return Scenario(
        requests=(
            RequestSpec("first", (*prefix, 43, 7, 38, 42, 27, 39), max_tokens=3),
            RequestSpec("second", prefix, max_tokens=2, salt="tenant-b"),
        ),
        mode=mode,
        num_blocks=8,
        token_budget=8,
        max_running=3,
        num_slots=8,
        eviction="arc",
        max_deferral_steps=1,
        prefix_caching=False,
        options=dict(options or {}),
    )


def tier_scenario(mode: StepMode = StepMode.BATCH_QUEUE, tier_loads: str = "direct") -> Scenario:
    """A prefix stored by one request, pushed below a six-slot host tier by another,
    then needed again: the third request loads it straight from the tier (``direct``)
    or waits for a promotion, then loads (``promote``)."""
    prefix = tuple(range(10, 26))  # four chunks
    return Scenario(
        requests=(
            RequestSpec("first", (*prefix, 90, 91), max_tokens=2),
            RequestSpec("other", tuple(range(60, 76)), max_tokens=1, arrival_step=3),
            RequestSpec("again", (*prefix, 92), max_tokens=2, arrival_step=6),
        ),
        mode=mode,
        num_blocks=12,
        token_budget=16,
        num_slots=6,
        max_deferral_steps=6,
        prefix_caching=False,
        lower_tier_slots=8,
        tier_loads=tier_loads,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvoffload interleaving explorer")
    parser.add_argument("--random", type=int, default=0, help="random schedules to run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--exhaustive", action="store_true", help="enumerate the seed scenario")
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument(
        "--disable-deferral",
        action="store_true",
        help="turn the in-flight deferral off (testing only): the explorer should fail",
    )
    args = parser.parse_args(argv)
    options = {"disable_deferral": True} if args.disable_deferral else {}
    reports = []
    if args.random:
        reports.append(("random", explore_random(args.random, args.seed, options)))
    if args.exhaustive:
        reports.append(
            ("exhaustive", explore_exhaustive(seed_race_scenario(options), depth=args.depth))
        )
    status = 0
    for name, report in reports:
        print(
            f"{name}: {report.schedules} schedules in {report.seconds:.1f} s "
            f"({report.per_second:.0f}/s): "
            + ("no violation" if report.failure is None else "VIOLATION")
        )
        if report.failure is not None:
            print(format_failure(shrink(report.failure)))
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
