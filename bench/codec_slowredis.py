"""The slow Redis link with a chunk codec: ``codec: fp8`` against ``codec: none`` on a
real engine, bytes on the wire and TTFT (issue 33, item 9).

Workload: the "slowtiers" capped chat (``bench/e2e_tiers.py``: 16 users x 6 turns on
the demo model, float32, greedy, 4 running requests, a small KV cache, the host tier
at 10% of the working set's raw bytes; ``--quick``: the tiny model, 2 turns) with the
Redis tier only: a private redis-server (``e2e_tiers.start_redis``, FLUSHALL before
every run) behind ``bench/throttle_proxy.py`` at a fixed ``--rate-mbps`` each way
(default 4 MB/s, shared by kvoffload's connections) plus ``--latency-ms`` (default 2)
on every request; a fresh proxy per run.

Configurations, per round (a fresh in-process engine each, the order reversed every
other round): ``no-offload`` (the small engine without a connector: the reference
outputs), ``none/cost`` and ``fp8/cost`` (kvoffload, ``codec`` none or fp8, the
default ``load_policy: cost``); with ``--always`` also ``none/always`` and
``fp8/always``. The host tier has the same bytes in every configuration, so with fp8
it holds about 4x the chunks of float32 KV; ``--fp8-small-host`` adds ``fp8s``: fp8
with the host bytes divided by fp8's ratio (3.996), the same chunks as ``none``, so
only the link's bytes differ.

Reported per configuration: mean TTFT (median over rounds) and its per-round ratio to
no offload; the bytes on the Redis link each way (redis-server's INFO
``total_net_input_bytes`` = to Redis, ``total_net_output_bytes`` = from Redis, read
before and after the run: every byte through the proxy, the engine's warm-up
included, plus the few KB of the admin client's INFO and FLUSHALL); kvoffload's
counters (prompt tokens served from kvoffload; host stores refused with every slot
pinned or in flight, as spills queued for the link pin theirs; chunks spilled to and
read from Redis; tokens whose load ``cost`` declined; failed chunks, spills / loads
and promotions; I/O timeouts; chunks read from Redis that failed verification, the
seal included); the requests whose outputs equal no offload's in each round. Then
the ratios fp8 / none (per-round medians) of the wire bytes and the mean TTFT. With
``--sealed`` also ``sealed/cost`` (codec none, ``seal_key_file`` set: the Redis tier
keeps sealed chunks, issue 41) and the ratio sealed / none of the mean TTFT
(``--no-fp8`` leaves the fp8 configurations out). Exit status 1 when a ``codec: none``
run's outputs (sealed or not) differ from no offload's, or a run fails; fp8's outputs
may differ (lossy) and are only reported.

    PYTHONPATH=src python bench/codec_slowredis.py [--quick] [--rounds 3]
        [--rate-mbps 4] [--latency-ms 2] [--always] [--fp8-small-host] [--sealed]
        [--no-fp8] [--users N] [--turns N]
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e_common import mismatches, per_round_ratio
from e2e_metrics import Counts, run_counted
from e2e_slowtiers import MB, REFERENCE, RUN_LIFETIME_S, with_policy
from e2e_tiers import TierSetup, make_setup, start_redis
from kvoffload.codecs import fp8_ratio
from kvoffload.demos.tiny_model import ensure_model
from kvoffload.demos.vllm_runner import RunResult, turn_batches
from kvoffload.sealing.keyfile import write_new
from throttle_proxy import ThrottleProxy

TIER = "redis"
SPILL, LOADS = ("spill",), ("load", "promote")  # directions: to the tier, out of it
WIRE = ("total_net_input_bytes", "total_net_output_bytes")  # to Redis, from Redis


@dataclass(frozen=True)
class Config:
    name: str
    codec: str | None = None  # None: no offload
    policy: str = "cost"
    small_host: bool = False  # host bytes / fp8's ratio: as many chunks as codec none
    sealed: bool = False  # seal_key_file set: Redis keeps sealed chunks (issue 41)


def configs(always: bool, small_host: bool, sealed: bool = False, fp8: bool = True) -> list[Config]:
    policies = ("cost", "always") if always else ("cost",)
    out = [Config(REFERENCE)]
    for p in policies:
        out += [Config(f"none/{p}", "none", p)] + ([Config(f"fp8/{p}", "fp8", p)] if fp8 else [])
        out += [Config(f"fp8s/{p}", "fp8", p, small_host=True)] if small_host else []
        out += [Config(f"sealed/{p}", "none", p, sealed=True)] if sealed else []
    return out


@dataclass
class Sample:
    """One run of one configuration."""

    result: RunResult
    counts: Counts | None = None
    wire: tuple[int, int] = (0, 0)  # bytes to Redis, from Redis


def wire_bytes(server: Any) -> tuple[int, int]:
    admin = server.client()
    try:
        stats = admin.info("stats")
    finally:
        admin.close()
    return stats[WIRE[0]], stats[WIRE[1]]


def seal_key(setup: TierSetup) -> Path:
    """The run's seal key file (made once, in the benchmark's own directory)."""
    path = setup.root / "seal.key"
    if not path.exists():
        write_new(path)
    return path


def run_one(
    setup: TierSetup, cfg: Config, rnd: int, server: Any, *, rate: float, latency: float
) -> Sample:
    batches = turn_batches(setup.workload.requests())
    if cfg.codec is None:
        return Sample(*run_counted(setup.engine(REFERENCE, rnd, None), batches))
    admin = server.client()
    admin.flushall()  # every run starts cold
    admin.close()
    before = wire_bytes(server)
    with ThrottleProxy(server.port, rate, latency, RUN_LIFETIME_S) as proxy:
        spec = setup.engine("host10+redis", rnd, f"redis://127.0.0.1:{proxy.port}/0")
        host = setup.host_small() / (fp8_ratio(4) if cfg.small_host else 1)
        seal = {"seal_key_file": str(seal_key(setup))} if cfg.sealed else {}
        spec = with_policy(spec, cfg.policy, codec=cfg.codec, cpu_bytes=int(host), **seal)
        result, counts = run_counted(spec, batches)
    after = wire_bytes(server)
    return Sample(result, counts, (after[0] - before[0], after[1] - before[1]))


def measure(
    setup: TierSetup, cfgs: list[Config], rate: float, latency: float
) -> tuple[dict[str, list[Sample]], dict[str, str]]:
    samples: dict[str, list[Sample]] = {c.name: [] for c in cfgs}
    failed: dict[str, str] = {}
    server = start_redis(setup)
    try:
        for rnd in range(setup.runs):
            for cfg in cfgs if rnd % 2 == 0 else cfgs[::-1]:
                if cfg.name in failed:
                    continue
                start = time.perf_counter()
                try:
                    s = run_one(setup, cfg, rnd, server, rate=rate, latency=latency)
                except Exception as exc:
                    traceback.print_exc()
                    failed[cfg.name] = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
                    print(f"  round {rnd + 1} {cfg.name}: failed: {failed[cfg.name]}")
                    continue
                samples[cfg.name].append(s)
                print(
                    f"  round {rnd + 1}/{setup.runs} {cfg.name}: "
                    f"{time.perf_counter() - start:.0f} s, mean TTFT "
                    f"{s.result.mean_ttft_s:.3f} s, wire to/from Redis "
                    f"{s.wire[0] / MB:.1f}/{s.wire[1] / MB:.1f} MB",
                    flush=True,
                )
    finally:
        server.kill()
    return samples, failed


def _med(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _counter(samples: list[Sample], get: Callable[[Counts], float]) -> str:
    value = _med([get(s.counts) for s in samples if s.counts is not None])
    return "-" if value is None else f"{value:.0f}"


def _sum(name: str, directions: tuple[str, ...] = (), **pairs: str) -> Callable[[Counts], int]:
    """A run's ``name`` series with ``pairs``, summed over ``directions`` (if any)."""
    if not directions:
        return lambda x: x.value(name, **pairs)
    return lambda x: sum(x.value(name, direction=d, **pairs) for d in directions)


def _same(samples: list[Sample], base: RunResult | None) -> str:
    if base is None or not samples:
        return "-"
    return ",".join(str(len(base.requests) - mismatches(base, [s.result])[0]) for s in samples)


def _ttfts(samples: list[Sample]) -> list[float]:
    return [s.result.mean_ttft_s for s in samples]


def _fmt(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def report(
    setup: TierSetup,
    cfgs: list[Config],
    samples: dict[str, list[Sample]],
    failed: dict[str, str],
    *,
    rate: float,
    latency: float,
) -> tuple[list[str], bool]:
    w = setup.workload
    base = samples[REFERENCE][0].result if samples[REFERENCE] else None
    total = len(base.requests) if base else 0
    lines = [
        f"codec_slowredis: model {setup.preset!r} float32 greedy, {w.users} users x {w.turns} "
        f"turns ({len(w.requests())} requests), working set {setup.working_bytes() / MB:.1f} MB "
        f"raw KV, host tier {setup.host_small() / MB:.2f} MB, Redis behind {rate / MB:g} MB/s "
        f"each way + {latency * 1e3:g} ms; {setup.runs} round(s), medians",
        f"  {'config':<12}{'TTFT s':>8}{'/no-off':>8}{'to Redis MB':>12}{'from MB':>9}"
        f"{'hit tok':>9}{'no room':>8}{'spills':>8}{'reads':>7}{'declined':>9}"
        f"{'failed s/l':>11}{'t/o':>5}{'integ':>6}{'unsettled':>10}   same outputs per round "
        f"(of {total})",
    ]
    ref = _ttfts(samples[REFERENCE])
    for cfg in cfgs:
        runs = samples[cfg.name]
        if not runs:
            lines.append(f"  {cfg.name:<12} not available: {failed.get(cfg.name, 'no runs')}")
            continue
        ttft = _med(_ttfts(runs))
        vs = per_round_ratio(_ttfts(runs), ref) if cfg.codec else None
        up = _med([s.wire[0] / MB for s in runs]) if cfg.codec else None
        down = _med([s.wire[1] / MB for s in runs]) if cfg.codec else None
        hit = _med([float(s.result.external_hit_tokens) for s in runs])

        spills = _counter(runs, _sum("transferred_chunks_total", SPILL, tier=TIER))
        reads = _counter(runs, _sum("transferred_chunks_total", LOADS, tier=TIER))
        declined = _counter(runs, _sum("declined_tokens_total", tier=TIER))
        failed = "/".join(_counter(runs, _sum("failed_chunks_total", d)) for d in (SPILL, LOADS))
        timeouts = _counter(runs, _sum("tier_io_timeouts_total"))
        integrity = _counter(runs, _sum("integrity_errors_total", tier=TIER))
        no_room = _counter(runs, _sum("no_room_total", tier="host"))
        unsettled = sum(1 for s in runs if s.counts is not None and not s.counts.settled)
        lines.append(
            f"  {cfg.name:<12}{_fmt(ttft, '.3f'):>8}{_fmt(vs, '.3f'):>8}{_fmt(up, '.1f'):>12}"
            f"{_fmt(down, '.1f'):>9}{_fmt(hit, '.0f'):>9}{no_room:>8}{spills:>8}{reads:>7}"
            f"{declined:>9}{failed:>11}{timeouts:>5}{integrity:>6}{unsettled:>10}   "
            f"{_same(runs, base)}"
        )
    for policy, variant in itertools.product(("cost", "always"), ("fp8", "fp8s")):
        none, fp8 = samples.get(f"none/{policy}"), samples.get(f"{variant}/{policy}")
        if not none or not fp8:
            continue
        ratios = [
            per_round_ratio([s.wire[i] for s in fp8], [s.wire[i] for s in none]) for i in (0, 1)
        ]
        ttft = per_round_ratio(_ttfts(fp8), _ttfts(none))
        lines.append(
            f"  {variant} / none ({policy}): bytes to Redis {_fmt(ratios[0], '.3f')}x, from Redis "
            f"{_fmt(ratios[1], '.3f')}x, mean TTFT {_fmt(ttft, '.3f')}x (per-round medians)"
        )
    for policy in ("cost", "always"):
        none, sealed = samples.get(f"none/{policy}"), samples.get(f"sealed/{policy}")
        if none and sealed:
            ttft = per_round_ratio(_ttfts(sealed), _ttfts(none))
            lines.append(
                f"  sealed / none ({policy}): mean TTFT {_fmt(ttft, '.3f')}x (per-round "
                "medians; goal <= 1.03x)"
            )
    ok = base is not None
    if base is None:
        lines.append("!!! OUTPUTS NOT CHECKED: no-offload did not run")
    for cfg in cfgs:
        if cfg.name in failed:
            lines.append(f"!!! {cfg.name} failed: {failed[cfg.name]}")
            ok = False
        if cfg.codec == "none" and base is not None and samples[cfg.name]:  # sealed too
            differ, _ = mismatches(base, [s.result for s in samples[cfg.name]])
            if differ:
                lines.append(f"!!! OUTPUT MISMATCH: {cfg.name}: {differ}/{total} requests differ")
                ok = False
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="the tiny model, 2 turns")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (3; --quick: 1)")
    parser.add_argument("--rate-mbps", type=float, default=4.0, help="MB/s each way (4)")
    parser.add_argument("--latency-ms", type=float, default=2.0, help="per request (2)")
    parser.add_argument("--always", action="store_true", help="also load_policy: always")
    parser.add_argument(
        "--fp8-small-host", action="store_true", help="also fp8 with none's host chunks"
    )
    parser.add_argument(
        "--sealed", action="store_true", help="also codec none with Redis sealed (seal_key_file)"
    )
    parser.add_argument("--no-fp8", action="store_true", help="leave fp8 out (with --sealed)")
    parser.add_argument("--users", type=int, default=None, help="chat users (16)")
    parser.add_argument("--turns", type=int, default=None, help="chat turns (6; --quick: 2)")
    args = parser.parse_args(argv)
    if not args.rate_mbps > 0 or args.latency_ms < 0 or (args.rounds or 1) < 1:
        parser.error("expected --rate-mbps > 0, --latency-ms >= 0, --rounds >= 1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    warnings.filterwarnings("ignore")
    started = time.perf_counter()
    base = Path("/var/tmp" if Path("/var/tmp").is_dir() else ".")
    root = Path(tempfile.mkdtemp(prefix="kvoffload-codec-slowredis-", dir=base))
    rate, latency = args.rate_mbps * MB, args.latency_ms / 1000
    cfgs = configs(args.always, args.fp8_small_host, args.sealed, fp8=not args.no_fp8)
    try:
        setup = make_setup(args.quick, args.rounds, args.users, args.turns, root)
        ensure_model(setup.preset)
        samples, failed = measure(setup, cfgs, rate, latency)
        lines, ok = report(setup, cfgs, samples, failed, rate=rate, latency=latency)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("\n" + "\n".join(lines))
    print(f"\nbenchmark took {time.perf_counter() - started:.0f} s; exit status {int(not ok)}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
