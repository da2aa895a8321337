"""The metrics recorder's counters: series checked against METRICS, scopes with a
fixed tier label, a scope moved onto another recorder, and every counter of METRICS
counted somewhere in the package (and nothing else)."""

from __future__ import annotations

import ast
import pathlib

import pytest

from kvoffload.core.errors import ContractViolation
from kvoffload.core.observe.metrics import METRICS
from kvoffload.core.observe.recorder import CounterScope, MetricsRecorder


def test_counts_add_up_per_series_and_read_back_by_labels() -> None:
    r = MetricsRecorder()
    r.count("lookups_total", tier="host")
    r.count("lookups_total", 2, tier="host")
    r.count("transferred_chunks_total", 3, tier="host", direction="load")
    assert r.value("lookups_total", tier="host") == 3
    assert r.value("transferred_chunks_total", direction="load", tier="host") == 3
    assert r.value("lookups_total", tier="disk") == 0  # never counted
    assert ("lookups_total", (("tier", "disk"),)) not in r.counters


def test_a_declared_series_exists_at_zero_and_keeps_its_count() -> None:
    r = MetricsRecorder()
    r.count("resets_total")
    r.declare("resets_total")
    r.declare("flushes_total")
    assert r.counters == {("resets_total", ()): 1, ("flushes_total", ()): 0}


@pytest.mark.parametrize(
    ("name", "pairs"),
    [
        ("lookups", {"tier": "host"}),  # no such metric
        ("usage_bytes", {"tier": "host"}),  # a gauge
        ("lookups_total", {}),  # a label missing
        ("resets_total", {"tier": "host"}),  # a label too many
    ],
)
def test_only_declared_counters_are_recorded(name: str, pairs: dict[str, str]) -> None:
    r = MetricsRecorder()
    with pytest.raises(ContractViolation):
        r.count(name, **pairs)
    with pytest.raises(ContractViolation):
        r.declare(name, **pairs)
    assert r.counters == {}


def test_breakdown_sums_by_one_label_in_first_recorded_order() -> None:
    r = MetricsRecorder()
    r.count("integrity_errors_total", tier="disk", reason="key")
    r.count("integrity_errors_total", tier="redis", reason="checksum")
    r.count("integrity_errors_total", 2, tier="disk", reason="checksum")
    assert r.breakdown("integrity_errors_total", "reason", tier="disk") == {"key": 1, "checksum": 2}
    assert list(r.breakdown("integrity_errors_total", "reason")) == ["key", "checksum"]
    assert r.breakdown("integrity_errors_total", "tier") == {"disk": 3, "redis": 1}


def test_a_scope_adds_its_tier_and_carries_its_series_when_rebound() -> None:
    disk = CounterScope.private(tier="disk")
    disk.declare("evictions_total", "no_room_total")
    disk.count("no_room_total", 2)
    shared = MetricsRecorder()
    shared.count("lookups_total", tier="host")
    disk.rebind(shared)
    disk.rebind(shared)  # no-op: nothing counted twice
    disk.count("no_room_total")
    assert disk.value("no_room_total") == 3 == shared.value("no_room_total", tier="disk")
    assert shared.counters == {
        ("lookups_total", (("tier", "host"),)): 1,
        ("evictions_total", (("tier", "disk"),)): 0,
        ("no_room_total", (("tier", "disk"),)): 3,
    }


SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "kvoffload"


def _counted_names() -> set[str]:
    """Names passed as a literal to a ``.count(...)`` call anywhere in the package."""
    names: set[str] = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "count"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                names.add(node.args[0].value)
    return names


def test_every_declared_counter_is_recorded_somewhere_and_nothing_else_is() -> None:
    declared = {m.name for m in METRICS if m.kind == "counter"}
    counted = {name for name in _counted_names() if name.endswith("_total")}
    assert declared - counted == set(), "declared in METRICS, never counted"
    assert counted - declared == set(), "counted, not a counter of METRICS"
