"""The report of the "tiers" workload (``bench/e2e_tiers.py``): TTFT against
never-evicting, kvoffload's counters, the simulator's predicted hits against the
measured (``bench/e2e_sim.py``), tier throughput against the baselines, targets."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import e2e_sim
from e2e_common import identical, med, output_checks, per_round_ratio, target
from e2e_metrics import Counts
from e2e_tiers import (
    KVOFFLOAD,
    LMCACHE,
    MAX_RUNNING,
    REFERENCE,
    TIER_THREADS,
    Rate,
    Results,
    TierSetup,
)
from kvoffload.core.chunk_format import HEADER_BYTES
from kvoffload.demos.chat_demo import BLOCK

MiB = 1 << 20


def ratio(res: Results, config: str) -> float | None:
    """Median over rounds of this config's mean TTFT / never-evicting's in the same round."""
    num = [r.mean_ttft_s for r in res.runs.get(config, [])]
    return per_round_ratio(num, [r.mean_ttft_s for r in res.runs[REFERENCE]])


def ttft_table(res: Results) -> list[str]:
    base = res.runs[REFERENCE][0] if res.runs[REFERENCE] else None
    lines = [
        f"  {'config':<16}{'mean TTFT':>10}{'p90':>9}{'/ never-ev.':>12}{'engine hits':>13}"
        f"{'connector hits':>16}{'outputs identical':>19}"
    ]
    for c in res.configs:
        runs = res.runs[c]
        if not runs:
            lines.append(f"  {c:<16}not available: {res.failed.get(c, 'did not run')}")
            continue
        r = ratio(res, c)
        lines.append(
            f"  {c:<16}{med(runs, lambda x: x.mean_ttft_s):>9.3f}s"
            f"{med(runs, lambda x: x.ttft_percentile(0.9)):>8.3f}s"
            f"{f'{r:.3f}x' if r is not None else 'n/a':>12}"
            f"{med(runs, lambda x: float(x.local_hit_tokens)):>13.0f}"
            f"{med(runs, lambda x: float(x.external_hit_tokens)):>16.0f}"
            f"{identical(base, runs):>19}"
        )
    return lines


def _median(counts: list[Counts], get: Callable[[Counts], float | None]) -> str:
    values = [v for v in (get(c) for c in counts) if v is not None]
    return f"{statistics.median(values):.0f}" if values else "n/a"


def _chunks(direction: str, tier: str) -> Callable[[Counts], float | None]:
    return lambda c: c.value("transferred_chunks_total", direction=direction, tier=tier)


def _series(name: str, **pairs: str) -> Callable[[Counts], float | None]:
    return lambda c: c.value(name, **pairs)


COUNTER_ROWS: tuple[tuple[str, Callable[[Counts], float | None]], ...] = (
    ("host stores (chunks)", _chunks("store", "host")),
    ("host evictions", _series("evictions_total", tier="host")),
    ("evicted without copy", lambda c: c.evicted_without_copy()),
    ("host no room", _series("no_room_total", tier="host")),
    ("spills to disk", _chunks("spill", "disk")),
    ("spills to redis", _chunks("spill", "redis")),
    ("disk evictions", _series("evictions_total", tier="disk")),
    ("promotions from disk", _chunks("promote", "disk")),
    ("promotions from redis", _chunks("promote", "redis")),
    ("tier loads from disk (chunks)", _chunks("load", "disk")),
    ("tier loads from redis (chunks)", _chunks("load", "redis")),
    ("disk lookups", _series("lookups_total", tier="disk")),
    ("redis lookups", _series("lookups_total", tier="redis")),
    ("tokens found on disk", _series("hit_tokens_total", tier="disk")),
    ("tokens found in redis", _series("hit_tokens_total", tier="redis")),
    ("tokens loaded (host->engine)", _series("hit_tokens_total", tier="host")),
    ("host loads (chunks)", _chunks("load", "host")),
    ("lookup deferrals", _series("deferrals_total", reason="lookup")),
    ("deferrals, all reasons", _series("deferrals_total")),
    ("deferral timeouts", _series("deferral_timeouts_total")),
    ("failed chunks", _series("failed_chunks_total")),
    ("missing chunks", _series("missing_chunks_total")),
    ("anomalies", _series("anomalies_total")),
    ("runs not settled at the end", lambda c: float(not c.settled)),
)


def counter_table(res: Results) -> list[str]:
    cols = [c for c in KVOFFLOAD if res.counts.get(c)]
    if not cols:
        return ["  no kvoffload run"]
    lines = [f"  {'':<30}" + "".join(f"{c:>15}" for c in cols)]
    for label, get in COUNTER_ROWS:
        lines.append(f"  {label:<30}" + "".join(f"{_median(res.counts[c], get):>15}" for c in cols))
    return lines


LMCACHE_ROWS = (  # label, LMCache server counter (Prometheus name without _total)
    ("lookup tokens requested", "lmcache_mp_lookup_requested_tokens"),
    ("lookup hit tokens (L1 + L2)", "lmcache_mp_lookup_hit_tokens"),
    ("  of which L1", "lmcache_mp_lookup_hit_l1_tokens"),
    ("  of which L2", "lmcache_mp_lookup_hit_l2_tokens"),
    ("L1 chunks written", "lmcache_mp_l1_write_chunks"),
    ("L1 chunks read", "lmcache_mp_l1_read_chunks"),
    ("L1 chunks evicted", "lmcache_mp_l1_evicted_chunks"),
    ("L1 allocation failures (chunks)", "lmcache_mp_l1_allocation_failure_chunks"),
    ("L2 chunks stored", "lmcache_mp_l2_store_completed_objects_chunks"),
)


def lmcache_table(res: Results) -> list[str]:
    """LMCache's server counters during the batches (medians over runs; a counter the
    server never exported counts as 0, as Prometheus counters appear on first use)."""
    cols = [c for c in LMCACHE if res.peer_counts.get(c)]
    if not cols:
        return ["  no LMCache run"]
    lines = [f"  {'':<34}" + "".join(f"{c:>16}" for c in cols)]
    for label, name in LMCACHE_ROWS:
        cells = [statistics.median(p.get(name, 0.0) for p in res.peer_counts[c]) for c in cols]
        lines.append(f"  {label:<34}" + "".join(f"{v:>16.0f}" for v in cells))
    return lines


RATE_ROWS = (  # label, config, direction, tier, baseline key
    ("spill host->disk", "host10+disk", "spill", "disk", "disk write"),
    ("promote disk->host", "host10+disk", "promote", "disk", "disk read"),
    ("spill host->redis", "host10+redis", "spill", "redis", "redis SET"),
    ("promote redis->host", "host10+redis", "promote", "redis", "redis GET"),
    ("tier load disk->engine", "host10+disk", "load", "disk", "disk read"),
    ("tier load redis->engine", "host10+redis", "load", "redis", "redis GET"),
)


def _rate(values: list[Rate]) -> Rate | None:
    if not values:
        return None
    return statistics.median(v[0] for v in values), statistics.median(v[1] for v in values)


def rate_table(setup: TierSetup, res: Results) -> list[str]:
    lines = [
        f"  {'transfer':<22}{'chunks/s':>10}{'GB/s':>8}   {'baseline':<26}{'chunks/s':>10}"
        f"{'GB/s':>8}{'GB/s ratio':>12}"
    ]
    names = {
        "disk write": "dd-like O_DIRECT write",
        "disk read": "dd-like O_DIRECT read",
        "redis SET": "redis-benchmark SET new",
        "redis GET": "redis-benchmark GET",
    }
    rows = [row for row in RATE_ROWS if row[1] in res.configs]
    if not rows:
        return ["  no tier configuration ran"]
    for label, config, direction, tier, key in rows:
        ours = _rate([r for r in (c.rate(direction, tier) for c in res.counts[config]) if r])
        base = _rate([b[key] for b in res.baselines if key in b])
        cells = f"{ours[0]:>10.0f}{ours[1]:>8.2f}" if ours else f"{'n/a':>10}{'n/a':>8}"
        bcells = f"{base[0]:>10.0f}{base[1]:>8.2f}" if base else f"{'n/a':>10}{'n/a':>8}"
        share = f"{ours[1] / base[1]:.2f}x" if ours and base and base[1] else "n/a"
        lines.append(f"  {label:<22}{cells}   {names[key]:<26}{bcells}{share:>12}")
    lines.append(
        f"  (kvoffload: bytes / summed job seconds of the transfer histograms; baselines: "
        f"{setup.baseline_chunks()} chunks of {setup.chunk_bytes} B, redis value "
        f"{HEADER_BYTES + setup.chunk_bytes} B, -c {TIER_THREADS} -P {setup.redis_pipeline})"
    )
    return lines


def without_copy_share(res: Results, config: str) -> float | None:
    counts = res.counts.get(config) or []
    shares = []
    for c in counts:
        lost = c.evicted_without_copy()
        if lost is None:
            return None
        evicted = c.value("evictions_total", tier="host")
        shares.append(lost / evicted if evicted else 0.0)
    return statistics.median(shares) if shares else None


def target_lines(res: Results) -> list[str]:
    lines = [
        target("host10+disk mean TTFT / never-evicting", ratio(res, "host10+disk"), "<=", 1.10),
        target("host10+redis mean TTFT / never-evicting", ratio(res, "host10+redis"), "<=", 1.15),
        target("host-big mean TTFT / never-evicting", ratio(res, "host-big"), "<=", 1.02),
    ]
    for c in ("host10+disk", "host10+redis"):
        share = without_copy_share(res, c)
        lines.append(target(f"{c} evicted without copy / host evictions", share, "<=", 0.01, ""))
    return lines


def sim_lines(setup: TierSetup, res: Results) -> list[str]:
    """The simulator's predicted hits next to the measured (``e2e_sim``); a failed
    simulation is reported, never raised (the measurements are worth more)."""
    try:
        return e2e_sim.report_lines(setup, res)
    except Exception as exc:
        return [f"simulator's prediction: failed: {type(exc).__name__}: {exc}"]


def report(setup: TierSetup, res: Results, simulate: bool = True) -> tuple[list[str], bool]:
    """The workload's report and whether its outputs (and kvoffload's runs) are all right;
    ``simulate``: with the simulator's predicted hits (``--no-sim``: without)."""
    w, ws = setup.workload, setup.workload.working_set_tokens()
    small, big = setup.small_tokens(), setup.big_tokens()
    lines = [
        f"tiers: model {setup.preset!r} float32 greedy, {w.users} users x {w.turns} turns, "
        f"system prompt {w.system_tokens}, messages {w.user_tokens[0]}-{w.user_tokens[1]}, "
        f"answers {w.output_tokens}; working set {ws} tokens ({setup.working_bytes() / MiB:.0f} "
        f"MiB), longest request {setup.longest()} tokens; max_num_seqs {MAX_RUNNING} everywhere",
        f"  small engine KV {small} tokens ({small / ws:.0%} of histories, "
        f"{(small - BLOCK) / setup.longest():.1f} longest requests); never-evicting {big} tokens; "
        f"host-big {setup.host_big() / MiB:.1f} MiB; host10 {setup.host_small() / MiB:.1f} MiB "
        f"({setup.host_small() // setup.chunk_bytes} chunks); disk {setup.host_big() / MiB:.1f} "
        f"MiB (O_DIRECT {setup.disk_o_direct}) under {setup.root}; LMCache L1 "
        f"{setup.lmcache_l1('lmcache') / MiB:.1f} MiB (lmcache) and "
        f"{setup.lmcache_l1('lmcache10+disk') / MiB:.1f} MiB "
        f"({setup.lmcache_l1('lmcache10+disk') // setup.chunk_bytes} chunks"
        f"{'' if setup.lmcache_small() == setup.host_small() else ', the longest request'}"
        f") + fs L2 (lmcache10+disk), chunk {BLOCK} tokens; {setup.runs} run(s), medians; "
        "ratios: median over rounds of the same round's ratio",
        *ttft_table(res),
        "",
        "kvoffload counters during the workload (median over runs):",
        *counter_table(res),
        "",
        "LMCache's server counters during the workload (median over runs; its lookups "
        "include tokens the engine's own prefix cache holds):",
        *lmcache_table(res),
        "",
        *([*sim_lines(setup, res), ""] if simulate else []),
        "tier transfer throughput (medians) vs baselines measured in the same run:",
        *rate_table(setup, res),
    ]
    checks, ok = output_checks(
        res.runs, res.configs, res.failed, REFERENCE, lambda c: c in KVOFFLOAD
    )
    lines += checks
    return lines, ok
