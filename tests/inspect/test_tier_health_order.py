"""``kvoffload inspect metrics`` shows the tiers in the registry's order (host memory
first, every tier of :func:`~kvoffload.tiers.registry.tier_names`), then any tier
name the registry does not know, sorted: a tier added to the registry is shown in its
place without touching the health report."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvoffload.inspection.exposition import parse_exposition
from kvoffload.inspection.tier_health import HOST, tier_health
from kvoffload.tiers import registry
from kvoffload.tiers.registry import LOWER_TIERS, tier_names


def shown(tiers: list[str]) -> list[str]:
    """The tiers a report of one ``lookups_total`` sample per tier of ``tiers`` shows."""
    text = "".join(f'kvoffload_lookups_total{{tier="{t}"}} 1\n' for t in tiers)
    return [t.tier for t in tier_health(parse_exposition(text), "test").tiers]


def test_the_tiers_follow_the_registry_then_unknown_names_sorted() -> None:
    assert tier_names()[0] == HOST
    scraped = ["zeta", *reversed(tier_names()), "alpha"]
    assert shown(scraped) == [*tier_names(), "alpha", "zeta"]


def test_a_tier_added_to_the_registry_is_shown_in_its_place(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tape = replace(LOWER_TIERS[0], name="tape")
    monkeypatch.setattr(registry, "TIERS", (registry.HOST, tape, *LOWER_TIERS))
    assert shown(["alpha", *reversed(tier_names())]) == [*tier_names(), "alpha"]
    assert tier_names()[1] == "tape"
