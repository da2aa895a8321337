"""``python -m kvoffload.testing.vllm_fuzz``: fuzz kvoffload on vLLM's own scheduler.

Each seed is a scenario (``scenario.py``) run on vLLM's real ``Scheduler`` and/or
``AsyncScheduler`` with real connectors and real copies (``runner.py``). Exit status
0 when every schedule passed, 1 with a report of the first failure (its seed, a
shrunk reproduction and the tail of its trace), 2 on bad arguments, 3 when a
schedule hung (its seed and every thread's stack are printed).
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections import Counter
from pathlib import Path

from kvoffload.testing.vllm_fuzz.runner import Environment, Outcome, run_scenario
from kvoffload.testing.vllm_fuzz.scenario import random_scenario
from kvoffload.testing.vllm_fuzz.shards import (
    ShardTotals,
    parse_shard,
    run_shards,
    shard_seeds,
)
from kvoffload.testing.vllm_fuzz.shared_host import (
    draws_shared_host,
    run_shared,
    shared_scenario,
)
from kvoffload.testing.vllm_fuzz.shrink import shrink


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m kvoffload.testing.vllm_fuzz",
        description="Fuzz kvoffload on vLLM's real scheduler (see docs/fuzzing.md). Each "
        "seed draws an engine (one full-attention KV cache group, or several: full "
        "attention and sliding windows, or windows only), tiers, requests, events "
        "and faults.",
    )
    parser.add_argument("--seeds", type=int, default=None, help="seeds to run (default 100)")
    parser.add_argument("--start", type=int, default=0, help="first seed (default 0)")
    parser.add_argument("--minutes", type=float, default=None, help="stop after this long")
    parser.add_argument(
        "--scheduler",
        choices=("sync", "async", "both"),
        default="both",
        help="which vLLM scheduler each seed runs on (both: every seed on each)",
    )
    parser.add_argument(
        "--shape",
        choices=("all", "shared-host"),
        default="all",
        help="all: every seed's drawn engine, plus, for an eighth of the seeds, several "
        "engines over one node-shared host tier with engines and its node process killed "
        "(shared-host); shared-host: that shape alone, for every seed",
    )
    parser.add_argument("--no-shrink", action="store_true", help="report failures unshrunk")
    parser.add_argument(
        "--schedule-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="a schedule still running after S seconds is a hang: print its seed and "
        "every thread's stack, exit 3 (default 300)",
    )
    parser.add_argument("--keep-going", action="store_true", help="do not stop at a failure")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress line")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        metavar="N",
        help="spread the seeds over N processes (each its own redis-server)",
    )
    parser.add_argument("--shard", default=None, help=argparse.SUPPRESS)  # k/N, from --jobs
    parser.add_argument("--summary", default=None, help=argparse.SUPPRESS)  # a shard's JSON
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be positive")
    try:
        args.shard = parse_shard(args.shard) if args.shard else (0, 1)
    except ValueError as exc:
        parser.error(str(exc))
    if args.seeds is None:
        args.seeds = None if args.minutes is not None else 100
    if (args.seeds is not None and args.seeds < 1) or (
        args.minutes is not None and args.minutes <= 0
    ):
        parser.error("--seeds and --minutes must be positive")
    return args


def quiet_vllm() -> None:
    """vLLM logs a line per engine built; a fuzzer builds thousands. kvoffload's own
    warnings (anomalies, refused per-request parameters) are what the scenarios
    provoke on purpose and what the harness checks: errors only."""
    import vllm  # noqa: F401  (configures vLLM's loggers first)

    logging.getLogger("vllm").setLevel(logging.ERROR)
    logging.getLogger("kvoffload").setLevel(logging.ERROR)


def kinds(choice: str) -> tuple[bool, ...]:
    return {"sync": (False,), "async": (True,), "both": (False, True)}[choice]


def report(failure: Outcome, shrunk: Outcome | None, runs: int) -> str:
    s = failure.scenario
    sched = "async" if s.async_scheduling else "sync"
    lines = [
        f"FAILED seed {s.seed} ({sched} scheduler): {failure.message}",
        f"  rerun: python -m kvoffload.testing.vllm_fuzz --seeds 1 --start {s.seed} "
        f"--scheduler {sched}",
    ]
    shown = shrunk or failure
    if shrunk is not None:
        lines.append(f"  shrunk in {runs} runs to:")
    lines += ["    " + line for line in shown.scenario.describe().splitlines()]
    if shrunk is not None and shrunk.message != failure.message:
        lines.append(f"  which fails with: {shrunk.message.splitlines()[0]}")
    lines.append("  trace (last 40 lines):")
    lines += ["    " + line for line in shown.trace[-40:]]
    return "\n".join(lines)


def hang_watchdog(seed: int, is_async: bool, seconds: float) -> threading.Timer:
    """A timer that, if one schedule runs longer than ``seconds`` (a hang: a wait
    nothing will end), prints the seed and every thread's stack and exits with 3."""

    def fire() -> None:
        sched = "async" if is_async else "sync"
        print(
            f"HUNG seed {seed} ({sched} scheduler): no end after {seconds:g} s; "
            f"rerun: python -m kvoffload.testing.vllm_fuzz --seeds 1 --start {seed} "
            f"--scheduler {sched}; every thread's stack:",
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
        sys.stdout.flush()
        os._exit(3)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.jobs > 1:
        return main_sharded(args, list(sys.argv[1:] if argv is None else argv))
    from kvoffload.demos.tiny_model import ensure_model

    quiet_vllm()
    # Terminated (a --jobs parent interrupted, a CI time-out): unwind, so the
    # redis-server and scratch directory of this run are closed as at its end.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    env = Environment(ensure_model("tiny"))
    totals: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    failures = 0
    begin = time.perf_counter()
    deadline = begin + args.minutes * 60 if args.minutes is not None else None
    last = args.start - 1
    try:
        for seed in shard_seeds(args.start, args.seeds, *args.shard):
            if deadline is not None and time.perf_counter() > deadline:
                break
            last = seed
            for is_async in kinds(args.scheduler):
                if args.shape == "shared-host" or draws_shared_host(seed):
                    watchdog = hang_watchdog(seed, is_async, args.schedule_timeout)
                    try:
                        shared = run_shared(shared_scenario(seed, is_async), env.model_path)
                    finally:
                        watchdog.cancel()
                    counts[shared.status] += 1
                    counts["async" if is_async else "sync"] += 1
                    totals.update(shared.stats)
                    if shared.failed:  # (not shrunk: a fleet's run is not shrunk yet)
                        failures += 1
                        print(shared.report(), flush=True)
                        if not args.keep_going:
                            raise StopIteration
                if args.shape == "shared-host":
                    continue
                scenario = random_scenario(seed, is_async, redis=env.redis_available)
                watchdog = hang_watchdog(seed, is_async, args.schedule_timeout)
                try:
                    outcome = run_scenario(scenario, env)
                finally:
                    watchdog.cancel()
                counts[outcome.status] += 1
                counts["async" if is_async else "sync"] += 1
                totals.update(outcome.stats)
                if outcome.failed:
                    failures += 1
                    shrunk, runs = (None, 0) if args.no_shrink else shrink(outcome, env)
                    print(report(outcome, shrunk, runs), flush=True)
                    if not args.keep_going:
                        raise StopIteration
            done = (seed - args.start) // args.shard[1] + 1
            if not args.quiet and done % 20 == 0:
                print(f"  {done} seeds, {time.perf_counter() - begin:.0f} s", file=sys.stderr)
    except StopIteration:
        pass
    finally:
        env.close()
    result = ShardTotals(counts, totals, last)
    if args.summary is not None:  # a shard of --jobs: the parent prints the summary
        Path(args.summary).write_text(result.to_json())
        return 1 if failures else 0
    summarize(args, result, time.perf_counter() - begin, env.redis_available)
    return 1 if failures else 0


def main_sharded(args: argparse.Namespace, argv: list[str]) -> int:
    """The run as ``args.jobs`` shard processes (``shards.py``)."""
    import shutil

    begin = time.perf_counter()
    passed_on = [a for i, a in enumerate(argv) if a != "--jobs" and argv[i - 1 : i] != ["--jobs"]]
    passed_on = [a for a in passed_on if not a.startswith("--jobs=")]
    status, totals = run_shards(passed_on, args.jobs)
    summarize(args, totals, time.perf_counter() - begin, shutil.which("redis-server") is not None)
    return status


def summarize(args: argparse.Namespace, result: ShardTotals, seconds: float, redis: bool) -> None:
    counts = result.counts
    schedules = counts["passed"] + counts["failed"]
    shards = f" over {args.jobs} processes" if args.jobs > 1 else ""
    print(
        f"{schedules} schedules ({counts['sync']} sync, {counts['async']} async) from seeds "
        f"{args.start}..{result.last_seed}: {counts['passed']} passed, {counts['failed']} "
        f"failed, in {seconds:.1f} s{shards}"
        + ("" if redis else " (no redis-server: Redis scenarios ran on disk)")
    )
    covered = ", ".join(f"{k} {v}" for k, v in sorted(result.stats.items()) if v)
    print(f"covered: {covered}")


if __name__ == "__main__":
    sys.exit(main())
