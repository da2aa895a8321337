"""End to end on a real vLLM engine: kvoffload against no offload, vLLM's connector
and an engine that never evicts.

Workloads (``--workload``, default ``all``), the same for every configuration:

- ``chat``: the demo's multi-turn chat (``kvoffload.workload.chat``): several users,
  a shared system prompt, growing histories; each turn of all users is one batch.
  The engine KV cache holds about a quarter of the working set, so histories are
  evicted between turns and only an offload tier can serve them. Configurations:
  (a) no connector; (b) vLLM's native OffloadingConnector with the CPU copy spec in
  ``vllm_cpu_offload_spec.py`` (the baseline); (c) kvoffload's connector
  (``kvoffload.vllm``), reported as unavailable if it cannot be imported or fails.
  Both connectors get the same host capacity (the whole working set fits).
  Targets: kvoffload mean TTFT <= 0.3x no offload and <= 1.0x vLLM's connector.
- ``zero``: zero reuse, every prompt unique, five batches of eight on the chat's
  engine; what offloading costs when nothing is ever loaded back (stores only).
  Throughput kvoffload / no offload is the median over ``--zero-pairs`` (default 5)
  rounds of the same round's ratio, the pair's order alternating between rounds.
  Target >= 0.99.
- ``tiers``: kvoffload's host, disk and Redis tiers against an engine whose KV cache
  never evicts, every engine at 4 running requests, beside vLLM's connector and
  LMCache 0.5.6 (multiprocess mode, in a venv of its own that the benchmark sets up on
  first use, ``bench/lmcache_env.py``; ``--no-lmcache`` leaves it out) with the same
  host bytes, and with its fs L2 for the small-host case (``bench/e2e_tiers.py``
  describes the eight configurations). Targets: host10+disk <= 1.10x never-evicting mean TTFT,
  host10+redis <= 1.15x, host-big <= 1.02x; chunks evicted from host memory without
  a lower-tier copy <= 1% of host evictions. The report also shows the simulator's
  predicted hit tokens and hit rate for the same requests and settings next to the
  measured (``bench/e2e_sim.py``; PASS within 10%; ``--no-sim`` leaves it out).
- ``slowtiers`` (only when named: ``all`` leaves it out; ``bench/e2e_slowtiers.py``):
  the tiers workload's capped chat with host memory at 10% over a slowed lower tier:
  Redis behind a bandwidth- and latency-limiting loopback proxy
  (``bench/throttle_proxy.py``), the disk tier with its reads and writes paced in the
  engine process; link speeds (``--speeds``, default 0.1,0.3,1,3,10) are multiples of
  the engine's recompute speed measured first in the same run (prefill tokens/s x KV
  bytes per token), plus ``--tier-latency-ms`` per request. Per speed and tier
  (``--tiers redis,disk``): no offload, kvoffload ``load_policy: always`` and
  ``load_policy: cost``. Targets: cost / min(no offload, always) mean TTFT <= 1.05 at
  every speed; cost / always <= 1.02 where the tier is fast (>= 3x); outputs
  identical to no offload.

Every (workload, configuration, run) gets a fresh in-process engine; runs are
interleaved across configurations and medians are reported. TTFT is vLLM's
per-request ``first_token_latency`` (see ``kvoffload.demos.vllm_runner``). Greedy
float32 outputs must equal the reference's (no offload for chat and slowtiers,
never-evicting for tiers): a difference, or a kvoffload tiers or slowtiers
configuration that fails, makes the exit status non-zero; a missed timing target only
prints FAIL.

Usage: ``python bench/e2e.py [--quick] [--workload tiers|chat|zero|slowtiers|all]
[--configs a,b] [--no-lmcache] [--runs N] [--zero-pairs N] [--no-sim] [--speeds 0.1,1,10] [--tiers
redis,disk] [--tier-latency-ms MS]``.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import e2e_chat
import e2e_slowtiers
import e2e_slowtiers_report
import e2e_tiers
import e2e_tiers_report
from e2e_chat import CONFIGS, ZERO_BATCHES
from e2e_common import med, same_outputs, target
from kvoffload.demos.chat_demo import kvoffload_unavailable
from kvoffload.demos.tiny_model import ensure_model
from kvoffload.demos.vllm_runner import turn_batches

__all__ = ["med", "same_outputs"]  # bench/tiers.py reads them from here

WORKLOADS = ("tiers", "chat", "zero")  # "all"; slowtiers only when named


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--quick", action="store_true", help="tiny model, small workloads, 1 run")
    parser.add_argument("--workload", choices=(*WORKLOADS, "slowtiers", "all"), default="all")
    everything = sorted({*CONFIGS, *e2e_tiers.CONFIGS})
    parser.add_argument(
        "--configs",
        default=None,
        help=f"comma-separated subset of {','.join(everything)} (default: all; the "
        "reference of each workload always runs)",
    )
    parser.add_argument(
        "--no-lmcache",
        action="store_true",
        help="tiers: leave out the LMCache configurations (no LMCache venv needed)",
    )
    parser.add_argument("--runs", type=int, default=None, help="runs per config (default 3)")
    parser.add_argument("--zero-pairs", type=int, default=None, help="zero-reuse rounds (5)")
    parser.add_argument("--async-scheduling", action="store_true", help="vLLM async (chat/zero)")
    parser.add_argument("--users", type=int, default=None, help="chat users (chat 8, tiers 16)")
    parser.add_argument("--turns", type=int, default=None, help="chat turns (chat 14, tiers 6)")
    parser.add_argument("--dir", type=Path, default=None, help="tiers: disk dir (/var/tmp)")
    parser.add_argument("--disk-o-direct", action="store_true", help="tiers: disk_o_direct")
    parser.add_argument("--redis-pipeline", type=int, default=1, help="redis-benchmark -P")
    parser.add_argument(
        "--no-sim", action="store_true", help="tiers: no simulator prediction (bench/e2e_sim.py)"
    )
    parser.add_argument(
        "--speeds",
        default=",".join(f"{s:g}" for s in e2e_slowtiers.SPEEDS),
        help="slowtiers: tier link speeds, multiples of the engine's recompute speed",
    )
    parser.add_argument(
        "--tiers", default=",".join(e2e_slowtiers.TIERS), help="slowtiers: redis,disk"
    )
    parser.add_argument(
        "--tier-latency-ms",
        type=float,
        default=e2e_slowtiers.LATENCY_MS,
        help=f"slowtiers: latency per tier request ({e2e_slowtiers.LATENCY_MS:g})",
    )
    args = parser.parse_args(argv)
    try:
        args.speeds = e2e_slowtiers.parse_speeds(args.speeds)
        args.tiers = e2e_slowtiers.parse_tiers(args.tiers)
    except ValueError as exc:
        parser.error(str(exc))
    args.workloads = WORKLOADS if args.workload == "all" else (args.workload,)
    chosen = set(everything) if args.configs is None else set(args.configs.split(","))
    if chosen - set(everything):
        parser.error(f"--configs: unknown {sorted(chosen - set(everything))}")
    args.chosen = chosen - set(e2e_tiers.LMCACHE) if args.no_lmcache else chosen
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup = e2e_chat.make_setup(args)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # read when torch is first imported
    started, status, targets = time.perf_counter(), 0, []

    available: dict[str, str | None] = {c: None for c in CONFIGS}
    for c in CONFIGS:
        if c not in args.chosen and c != "no-offload":
            available[c] = "not selected (--configs)"
    reason = kvoffload_unavailable()
    if reason is not None:
        available["kvoffload"] = f"kvoffload connector not available yet ({reason})"
    report: list[str] = []
    c, z = setup.chat.workload, setup.zero
    if {"chat", "zero"} & set(args.workloads):
        ensure_model(setup.chat.preset)
        kv_tokens = setup.chat.kv_cache_tokens()
        report.append(
            f"model {setup.chat.preset!r}, float32, block 32, 1 torch thread; engine KV "
            f"{kv_tokens} tokens ({kv_tokens / c.working_set_tokens():.0%} of the chat working "
            f"set {c.working_set_tokens()}); host tier {setup.chat.host_bytes() >> 20} MiB; "
            f"async scheduling {setup.async_scheduling}"
        )
    if "chat" in args.workloads:
        batches = turn_batches(c.requests())
        chat = e2e_chat.measure(setup, "chat", batches, available, rounds=setup.runs)
        report += [
            f"\nchat: {c.users} users x {c.turns} turns, system prompt {c.system_tokens}, "
            f"messages {c.user_tokens[0]}-{c.user_tokens[1]}, answers {c.output_tokens} tokens; "
            f"{setup.runs} run(s), medians",
            e2e_chat.chat_table(chat, available),
            *e2e_chat.ratio_lines(chat),
        ]
        status |= 0 if e2e_chat.chat_ok(chat) else 1
    if "zero" in args.workloads:
        zero = e2e_chat.measure(
            setup,
            "zero reuse",
            setup.zero_batches(),
            available,
            rounds=setup.zero_pairs,
            alternate=True,
        )
        ratio = e2e_chat.zero_ratio(zero, "vllm-offload")
        vllm_zero = f"{ratio:.3f}x" if ratio is not None else "n/a"
        report += [
            f"\nzero reuse: {z.users} unique prompts of {z.user_tokens[0]}-{z.user_tokens[1]} "
            f"tokens, {z.output_tokens} generated each, {ZERO_BATCHES} batches (wall: all of "
            f"them); {setup.zero_pairs} interleaved round(s), medians",
            e2e_chat.zero_table(zero, available),
            f"  vLLM connector zero-reuse throughput / no offload: {vllm_zero} (reference)",
        ]
        label = f"zero-reuse throughput kvoffload / no offload ({setup.zero_pairs} pairs)"
        targets.append(target(label, e2e_chat.zero_ratio(zero, "kvoffload"), ">=", 0.99))
    if "tiers" in args.workloads:
        base = args.dir or Path("/var/tmp" if Path("/var/tmp").is_dir() else ".")
        root = Path(tempfile.mkdtemp(prefix="kvoffload-e2e-tiers-", dir=base))
        try:
            tiers = e2e_tiers.make_setup(
                args.quick,
                args.runs,
                args.users,
                args.turns,
                root,
                disk_o_direct=args.disk_o_direct,
                redis_pipeline=args.redis_pipeline,
            )
            ensure_model(tiers.preset)
            res = e2e_tiers.measure(tiers, sorted(args.chosen))
            lines, ok = e2e_tiers_report.report(tiers, res, simulate=not args.no_sim)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        report += ["", *lines]
        targets += e2e_tiers_report.target_lines(res)
        status |= 0 if ok else 1
    if "slowtiers" in args.workloads:
        base = args.dir or Path("/var/tmp" if Path("/var/tmp").is_dir() else ".")
        root = Path(tempfile.mkdtemp(prefix="kvoffload-e2e-slowtiers-", dir=base))
        try:
            tiers = e2e_tiers.make_setup(args.quick, args.runs, args.users, args.turns, root)
            slow = e2e_slowtiers.SlowSetup(
                tiers, args.speeds, args.tiers, args.tier_latency_ms / 1000
            )
            ensure_model(tiers.preset)
            sres = e2e_slowtiers.measure(slow)
            lines, ok = e2e_slowtiers_report.report(slow, sres)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        report += ["", *lines]
        targets += e2e_slowtiers_report.target_lines(slow, sres)
        status |= 0 if ok else 1
    print("\n" + "\n".join(report))
    if targets:
        print("\ntargets (timing targets never change the exit status):")
        print("\n".join(targets))
    print(f"\nbenchmark took {time.perf_counter() - started:.0f} s; exit status {status}")
    return status


if __name__ == "__main__":
    logging.getLogger("torch._library.triton").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    sys.exit(main())
