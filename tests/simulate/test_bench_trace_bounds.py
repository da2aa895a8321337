"""``bench/trace_bounds.py``: the relaxed bound is the linear program's value (checked
against its dual, brute-forced), never below a deterministic rule that fits, and the
table holds the limits it must on a small Mooncake-style trace."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
from tests.bench_modules import bench_module

tb = bench_module("trace_bounds")


def random_spans(rng: random.Random) -> dict[tuple[int, ...], list[tuple[float, int]]]:
    spans = {}
    for cls in range(rng.randint(1, 3)):
        items = [
            (float(rng.randint(0, 9)), rng.choice((0, 0, 512, 300)))
            for _ in range(rng.randint(1, 4))
        ]
        spans[(cls,)] = sorted(items)
    return spans


def dual(spans: dict[tuple[int, ...], list[tuple[float, int]]], capacity: float) -> float:
    """min over prices of price x capacity + each class's best hits - price x occupancy;
    the function is convex and piecewise linear, its minimum at 0 or a breakpoint (a
    slope between two points of one class's curve)."""
    curves = [tb.curve(items) for items in spans.values()]
    prices = {0.0}
    for c in curves:
        for (_, x1, y1), (_, x2, y2) in itertools.combinations(c, 2):
            if x2 != x1:
                prices.add(abs((y2 - y1) / (x2 - x1)))
    return min(p * capacity + sum(max(y - p * x for _, x, y in c) for c in curves) for p in prices)


@pytest.mark.parametrize("seed", range(200))
def test_the_relaxed_bound_is_the_programs_value_and_beats_every_fitting_rule(seed: int) -> None:
    rng = random.Random(seed)
    spans = random_spans(rng)
    capacity = float(rng.randint(0, 40))
    value = tb.relaxed_bound(spans, capacity)
    assert value == pytest.approx(dual(spans, capacity))
    curves = [tb.curve(items) for items in spans.values()]
    fitting = [
        sum(y for _, _, y in choice)
        for choice in itertools.product(*curves)
        if sum(x for _, x, _ in choice) <= capacity
    ]
    assert value >= max(fitting) - 1e-9


def test_a_curve_counts_a_threshold_once_per_length_and_holds_longer_intervals_for_it() -> None:
    # three intervals of lengths 2, 2, 5 (the last no hit): at A = 2 both short ones
    # hit and the long one is held for 2
    assert tb.curve([(2.0, 512), (2.0, 100), (5.0, 0)]) == [
        (0.0, 0.0, 0.0),
        (2.0, 6.0, 612.0),
        (5.0, 9.0, 612.0),
    ]


def test_the_table_orders_the_limits_on_a_small_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "mooncake.jsonl"
    lines = []
    for i in range(40):  # five users, a shared block, growing histories, one-off tails
        user = i % 5
        full = [0] + [1000 * user + k for k in range(1, i // 5 + 2)]
        line = {"timestamp": 500 * i, "input_length": 512 * len(full) + 100, "output_length": 8}
        lines.append(json.dumps({**line, "hash_ids": [*full, 10_000 + i]}))
    trace.write_text("\n".join(lines) + "\n")
    assert (
        tb.main(
            ["--trace", str(trace), "--shares", "20,100", "--engine-chunks", "0", "--admission"]
        )
        == 0
    )
    out = capsys.readouterr().out.splitlines()
    assert "40 requests" in out[0]

    def row(prefix: str) -> list[float]:
        line = next(x for x in out if x.startswith(prefix))
        return [float(cell.rstrip("%")) for cell in line[62:].split() if cell.endswith("%")]

    optimum, lru = row("optimum"), row("lru (host-only")
    age_only, reuse, oracle = row("(age only) "), row("output+reuse "), row("oracle ")
    for k in range(2):
        assert lru[k] <= optimum[k] <= oracle[k]
        assert lru[k] <= age_only[k] <= reuse[k] <= oracle[k]
    # with every distinct chunk fitting, the relaxation serves the infinite cache
    assert oracle[1] == optimum[1]
