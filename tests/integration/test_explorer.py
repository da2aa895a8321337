"""The interleaving explorer over the reference engine: no interleaving breaks the
scheduler half, and the explorer demonstrably finds what it is meant to find."""

from __future__ import annotations

import pytest

from kvoffload.core.directory import Directory
from kvoffload.core.scheduler import stores
from kvoffload.engine.settings import StepMode
from kvoffload.testing.explorer import (
    explore_exhaustive,
    explore_random,
    format_failure,
    seed_race_scenario,
    shrink,
    tier_scenario,
)
from kvoffload.testing.policies import Choice

DISABLED = {"disable_deferral": True}


def test_ten_thousand_random_schedules_break_nothing() -> None:
    report = explore_random(10_000, seed=20261130)
    assert report.failure is None, format_failure(shrink(report.failure))
    print(f"random: {report.schedules} schedules, {report.per_second:.0f}/s")


@pytest.mark.parametrize("mode", [StepMode.SYNC, StepMode.BATCH_QUEUE])
@pytest.mark.parametrize(
    "choices, depth",
    [
        ((Choice.ALL, Choice.NONE, Choice.OLDEST), 8),
        ((Choice.ALL, Choice.NONE, Choice.FAIL_OLDEST), 7),
    ],
)
def test_every_completion_order_of_the_seed_scenario_is_safe(
    mode: StepMode, choices: tuple[Choice, ...], depth: int
) -> None:
    report = explore_exhaustive(seed_race_scenario(mode=mode), depth=depth, choices=choices)
    assert report.failure is None, format_failure(shrink(report.failure))
    assert report.schedules > 500  # the search really branched
    print(f"exhaustive {mode.value} {[c.value for c in choices]}: {report.schedules} schedules")


@pytest.mark.parametrize("mode", [StepMode.SYNC, StepMode.BATCH_QUEUE])
@pytest.mark.parametrize(
    "choices, depth",
    [
        ((Choice.ALL, Choice.NONE, Choice.OLDEST), 7),
        ((Choice.ALL, Choice.NONE, Choice.FAIL_OLDEST), 6),
    ],
)
def test_every_completion_order_of_spills_and_promotions_is_safe(
    mode: StepMode, choices: tuple[Choice, ...], depth: int
) -> None:
    report = explore_exhaustive(tier_scenario(mode), depth=depth, choices=choices)
    assert report.failure is None, format_failure(shrink(report.failure))
    assert report.schedules > 300
    print(f"exhaustive tiers {mode.value} {[c.value for c in choices]}: {report.schedules}")


@pytest.mark.parametrize("mode", [StepMode.SYNC, StepMode.BATCH_QUEUE])
def test_without_the_deferral_the_exhaustive_search_finds_the_seed_race(mode: StepMode) -> None:
    report = explore_exhaustive(seed_race_scenario(DISABLED, mode=mode), depth=8)
    assert report.failure is not None
    minimal = shrink(report.failure)
    assert minimal.outcome.category == "load while jobs in flight"
    text = format_failure(minimal)
    print(text)
    # The printed schedule shows the re-admission looked up with a store in flight.
    assert "jobs in flight [" in text and "-> LOADING is not allowed" in text
    assert len(minimal.scenario.requests) <= 2


def test_without_the_deferral_the_random_search_finds_the_seed_race() -> None:
    report = explore_random(4000, seed=2, options=DISABLED)
    assert report.failure is not None
    assert report.failure.outcome.category == "load while jobs in flight"
    print(format_failure(shrink(report.failure)))


def test_the_fence_check_has_teeth(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stores, "fenced_stores", lambda *args: set())
    report = explore_random(3000, seed=3)
    assert report.failure is not None
    assert report.failure.outcome.category in ("wrong bytes", "block overwritten under a store")


def test_the_byte_check_has_teeth(monkeypatch: pytest.MonkeyPatch) -> None:
    complete_store = Directory.complete_store
    monkeypatch.setattr(
        Directory, "complete_store", lambda self, keys, success: complete_store(self, keys, True)
    )
    report = explore_random(3000, seed=3)
    assert report.failure is not None and report.failure.outcome.category == "wrong bytes"
