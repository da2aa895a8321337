"""Helpers shared by the ``bench/e2e*.py`` workloads: medians over runs, output
comparison against a reference configuration, target lines with PASS/FAIL."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence

from kvoffload.demos.vllm_runner import RunResult


def med(runs: Sequence[RunResult], metric: Callable[[RunResult], float]) -> float:
    return statistics.median(metric(r) for r in runs)


def same_outputs(a: RunResult, b: RunResult) -> str:
    same = sum(x.token_ids == y.token_ids for x, y in zip(a.requests, b.requests, strict=True))
    return f"{same}/{len(a.requests)}"


def mismatches(base: RunResult, runs: Sequence[RunResult]) -> tuple[int, int]:
    """(requests whose greedy tokens differ from ``base``'s in some run, requests per run)."""
    differ = set()
    for r in runs:
        for i, (x, y) in enumerate(zip(base.requests, r.requests, strict=True)):
            if x.token_ids != y.token_ids:
                differ.add(i)
    return len(differ), len(base.requests)


def output_checks(
    runs: Mapping[str, Sequence[RunResult]],
    configs: Iterable[str],
    failed: Mapping[str, str],
    reference: str,
    must_run: Callable[[str], bool],
) -> tuple[list[str], bool]:
    """The ``!!!`` lines of a report, and whether it is fine: ``reference`` ran, every
    configuration's outputs equal its first run's, and every configuration
    ``must_run`` accepts ran."""
    lines: list[str] = []
    ok = True
    base = runs[reference][0] if runs[reference] else None
    if base is None:
        lines.append(f"!!! OUTPUTS NOT CHECKED: {reference} did not run")
        ok = False
    for c in configs:
        if base is not None and runs[c]:
            differ, total = mismatches(base, runs[c])
            if differ:
                lines.append(f"!!! OUTPUT MISMATCH: {c}: {differ}/{total} requests differ")
                ok = False
        if must_run(c) and c in failed:
            lines.append(f"!!! {c} did not run: {failed[c]}")
            ok = False
    return lines, ok


def identical(base: RunResult | None, runs: Sequence[RunResult]) -> str:
    """``n/N``: requests whose tokens equal ``base``'s in every run ('-': nothing to compare)."""
    if base is None or not runs:
        return "-"
    differ, total = mismatches(base, runs)
    return f"{total - differ}/{total}"


def per_round_ratio(num: Sequence[float], den: Sequence[float]) -> float | None:
    """Median over rounds of ``num[i] / den[i]`` (rounds both sides ran)."""
    ratios = [n / d for n, d in zip(num, den, strict=False) if d]
    return statistics.median(ratios) if ratios else None


def target(label: str, value: float | None, op: str, bound: float, unit: str = "x") -> str:
    """``  label  value  (target op bound) PASS|FAIL`` (n/a when there is no value)."""
    if value is None:
        return f"  {label:<52}{'n/a':>9}   (target {op} {bound:g}{unit})  n/a"
    ok = value <= bound if op == "<=" else value >= bound
    return (
        f"  {label:<52}{value:>8.3f}{unit}   (target {op} {bound:g}{unit})  "
        f"{'PASS' if ok else 'FAIL'}"
    )
