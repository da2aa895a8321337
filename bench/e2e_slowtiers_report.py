"""The report of the "slowtiers" workload (``bench/e2e_slowtiers.py``): mean TTFT of
load_policy always and cost against no offload at each tier speed, kvoffload's
counters, the targets."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from e2e_common import identical, output_checks, per_round_ratio, target
from e2e_metrics import GB, Counts
from e2e_slowtiers import (
    CALIBRATION_BATCHES,
    FAST,
    MB,
    REFERENCE,
    SlowResults,
    SlowSetup,
    config_name,
)
from e2e_tiers import MAX_RUNNING


def _ttfts(res: SlowResults, config: str) -> list[float]:
    return [r.mean_ttft_s for r in res.runs.get(config, [])]


def _mean_ttft(res: SlowResults, config: str) -> float | None:
    values = _ttfts(res, config)
    return statistics.median(values) if values else None


def cost_vs_best(res: SlowResults, tier: str, speed: float) -> float | None:
    """Median over rounds of cost / min(no offload, always) in the same round."""
    base = _ttfts(res, REFERENCE)
    always = _ttfts(res, config_name(tier, speed, "always"))
    best = [min(b, a) for b, a in zip(base, always, strict=False)]
    return per_round_ratio(_ttfts(res, config_name(tier, speed, "cost")), best)


def cost_vs_always(res: SlowResults, tier: str, speed: float) -> float | None:
    num = _ttfts(res, config_name(tier, speed, "cost"))
    return per_round_ratio(num, _ttfts(res, config_name(tier, speed, "always")))


def _median(res: SlowResults, config: str, get: Callable[[Counts], float | None]) -> str:
    values = [v for v in (get(c) for c in res.counts.get(config, [])) if v is not None]
    return f"{statistics.median(values):.0f}" if values else "-"


def _reads(tier: str) -> Callable[[Counts], float]:
    """Chunks read from ``tier``: its loads into the engine and its promotions."""
    return lambda c: sum(
        c.value("transferred_chunks_total", direction=d, tier=tier) for d in ("load", "promote")
    )


def _series(name: str, **pairs: str) -> Callable[[Counts], float]:
    return lambda c: c.value(name, **pairs)


def _read_rate(res: SlowResults, config: str, tier: str) -> str:
    rates = [r[1] for r in (c.rate("load", tier) for c in res.counts.get(config, [])) if r]
    return f"{statistics.median(rates) * GB / MB:.1f}" if rates else "-"


def _cell(value: float | None, fmt: str) -> str:
    return format(value, fmt) if value is not None else "n/a"


def _identical(res: SlowResults, config: str) -> str:
    base = res.runs[REFERENCE][0] if res.runs[REFERENCE] else None
    return identical(base, res.runs[config])


def ttft_table(setup: SlowSetup, res: SlowResults) -> list[str]:
    rec = res.recompute
    lines = [
        f"  {'tier':<6}{'speed':>6}{'link MB/s':>10}{'always':>9}{'cost':>9}"
        f"{'cost/min':>10}{'cost/alw':>10}{'declined tok':>13}{'reads a/c':>12}"
        f"{'read MB/s a/c':>15}{'failed a/c':>12}{'timeouts a/c':>14}{'identical a/c':>15}"
    ]
    for tier in setup.tier_names:
        for speed in setup.speeds:
            a, c = config_name(tier, speed, "always"), config_name(tier, speed, "cost")

            def both(get: Callable[[str], str], a: str = a, c: str = c) -> str:
                return f"{get(a)}/{get(c)}"

            link = speed * rec.bytes_per_s / MB if rec else 0.0
            declined = _median(res, c, _series("declined_tokens_total", tier=tier))
            reads = both(lambda n, t=tier: _median(res, n, _reads(t)))
            rate = both(lambda n, t=tier: _read_rate(res, n, t))
            failed = both(lambda n: _median(res, n, _series("failed_chunks_total")))
            timeouts = both(lambda n: _median(res, n, _series("tier_io_timeouts_total")))
            lines.append(
                f"  {tier:<6}{f'{speed:g}x':>6}{link:>10.1f}"
                f"{_cell(_mean_ttft(res, a), '.3f'):>9}{_cell(_mean_ttft(res, c), '.3f'):>9}"
                f"{_cell(cost_vs_best(res, tier, speed), '.3f'):>10}"
                f"{_cell(cost_vs_always(res, tier, speed), '.3f'):>10}"
                f"{declined:>13}{reads:>12}{rate:>15}{failed:>12}{timeouts:>14}"
                f"{_identical(res, a) + ' ' + _identical(res, c):>15}"
            )
    for name in (REFERENCE, *setup.configs()):
        if name in res.failed:
            lines.append(f"  {name}: not available: {res.failed[name]}")
    return lines


REASONS = ("transfer", "queue", "unmeasured", "unanswered")


def declines_table(setup: SlowSetup, res: SlowResults) -> list[str]:
    """``load_policy: cost``'s declines by reason (median lookups per run): why the
    cost runs recomputed what they did."""
    lines = [f"  cost's declines (lookups, median per run): {'tier':<6}{'speed':>6}"
             + "".join(f"{r:>12}" for r in REASONS)]  # fmt: skip
    for tier in setup.tier_names:
        for speed in setup.speeds:
            c = config_name(tier, speed, "cost")
            cells = "".join(
                f"{_median(res, c, _series('hits_declined_total', tier=tier, reason=r)):>12}"
                for r in REASONS
            )
            lines.append(f"  {'':<42}{tier:<6}{f'{speed:g}x':>6}{cells}")
    return lines


def report(setup: SlowSetup, res: SlowResults) -> tuple[list[str], bool]:
    """The workload's report and whether its outputs (and kvoffload's runs) are all right."""
    ts, w, rec = setup.tiers, setup.tiers.workload, res.recompute
    speed_line = (
        f"  recompute speed, measured first: {rec.tokens_per_s:.0f} prefill tokens/s "
        f"(median of {CALIBRATION_BATCHES} batches of {MAX_RUNNING} fresh {rec.prompt_tokens}-"
        f"token prompts, no offload) x {rec.token_bytes} B/token = {rec.bytes_per_s / MB:.1f} "
        f"MB/s; link = speed x that, plus {setup.latency_s * 1000:g} ms per request"
        if rec
        else "  recompute speed: not measured"
    )
    lines = [
        f"slowtiers: model {ts.preset!r} float32 greedy, {w.users} users x {w.turns} turns, "
        f"system prompt {w.system_tokens}, messages {w.user_tokens[0]}-{w.user_tokens[1]}, "
        f"answers {w.output_tokens}; max_num_seqs {MAX_RUNNING}; small engine KV "
        f"{ts.small_tokens()} tokens; host10 {ts.host_small() / (1 << 20):.1f} MiB over "
        f"{'/'.join(setup.tier_names)}; {ts.runs} run(s), medians; ratios: median over "
        "rounds of the same round's ratio",
        speed_line,
        f"  no offload mean TTFT {_cell(_mean_ttft(res, REFERENCE), '.3f')} s; "
        "always / cost: mean TTFT (s); cost/min = cost / min(no offload, always); "
        "a/c = always/cost; loads: chunks read from the tier (loads and promotions); "
        "read MB/s: kvoffload's per-job tier load rate",
        *ttft_table(setup, res),
        *declines_table(setup, res),
    ]
    checks, ok = output_checks(
        res.runs, res.configs, res.failed, REFERENCE, lambda c: c != REFERENCE
    )
    lines += checks
    return lines, ok


def target_lines(setup: SlowSetup, res: SlowResults) -> list[str]:
    lines = []
    for tier in setup.tier_names:
        for speed in setup.speeds:
            label = f"{tier} {speed:g}x: cost / min(no offload, always)"
            lines.append(target(label, cost_vs_best(res, tier, speed), "<=", 1.05))
            if speed >= FAST:
                label = f"{tier} {speed:g}x: cost / always (fast tier)"
                lines.append(target(label, cost_vs_always(res, tier, speed), "<=", 1.02))
    return lines
