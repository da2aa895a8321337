"""The arguments of ``kvoffload simulate`` and what they build: the parser, the
workload (the built-in chat, or a trace with ``--head`` and ``--time-scale``), the
settings (``--chunk-tokens`` matched to a Mooncake trace's block) and the tiers'
sizes (bytes, chunks, or shares of the workload's distinct chunks).

Bad values raise :class:`~kvoffload.core.errors.UsageError` naming the option.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from typing import NoReturn

from kvoffload.core.errors import UsageError
from kvoffload.core.kv_groups import ONE_GROUP
from kvoffload.core.policies import policy_names
from kvoffload.simulate.chat import ChatTrace
from kvoffload.simulate.codec_arguments import add_codec_arguments, codecs_of
from kvoffload.simulate.cost import CostModel
from kvoffload.simulate.groups import parse_kv_groups
from kvoffload.simulate.mooncake import DEFAULT_BLOCK_TOKENS, MOONCAKE
from kvoffload.simulate.optimum import References
from kvoffload.simulate.routing import ROUTES, ReplicaSetup
from kvoffload.simulate.settings import SimConfig
from kvoffload.simulate.sweep import Workload
from kvoffload.simulate.trace import TraceFile
from kvoffload.simulate.units import ChunkUnits, parse_size
from kvoffload.tiers.registry import HOST, LOWER_TIERS
from kvoffload.workload.chat import ChatWorkload

_DEFAULTS = SimConfig(cpu_bytes=64 * 2**30)
_COST = CostModel()

_LOWER = LOWER_TIERS[0].name  # the examples' lower tier

_EPILOG = f"""\
Without --trace the built-in multi-turn chat workload runs. A trace is this
simulator's JSONL or a Mooncake-style one (hash_ids), detected from its first line.
Sizes accept units (8GiB, 512MiB, 1.5GB), chunks (9139chunks) or a share of the
workload's distinct chunks (5%), both counted in raw chunks' bytes: a tier with a
codec holds more chunks in them. Every report shows the hits against the workload's
limits (an infinite cache, and the offline optimum at the host's capacity). See
docs/simulate.md for the trace formats, the cost model and sizing advice.

examples:
  kvoffload simulate                                   # built-in chat, 64GiB host
  kvoffload simulate --cpu-bytes 16GiB --{_LOWER}-bytes 1TiB
  kvoffload simulate --trace my.jsonl --json results.json
  kvoffload simulate --trace mooncake.jsonl --cpu-bytes 5% --time-scale 2.5
  kvoffload simulate --trace mooncake.jsonl --cpu-bytes 5% --codec fp8
  kvoffload simulate --trace mooncake.jsonl --head 2000 --sweep 5%,10%,25%,50%
  kvoffload simulate --sweep 8GiB,16GiB,32GiB,64GiB,128GiB --output sweep.png
  kvoffload simulate --users 20 --turns 3 --write-trace example.jsonl
  kvoffload simulate --cpu-bytes 1GiB --{_LOWER}-bytes 1TiB --tier-bandwidth 0.05,0.2,1,4
  kvoffload simulate --kv-groups full,5xwindow=1024     # a Gemma-3-style hybrid model
  kvoffload simulate --replicas 4 --host-share          # 4 engines, one shared host tier

--kv-groups lists a hybrid model's KV cache groups (full, window=TOKENS, NxGROUP);
--engine-tokens and --bytes-per-token stay the whole model's: with G groups each
block and chunk holds 1/G of the layers.
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see kvoffload simulate --help)")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="kvoffload simulate",
        description="Replay a workload through the reference engine with kvoffload's "
        "scheduler half, directories and eviction policies, and a cost model: hit rate, "
        "recompute avoided, traffic per tier; --sweep charts hit rate against host memory.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    w = p.add_argument_group("workload")
    w.add_argument("--trace", metavar="FILE", help="replay this JSONL trace (or Mooncake's)")
    w.add_argument("--head", type=int, metavar="N", help="only the trace's first N requests")
    w.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        metavar="F",
        help="multiply the trace's arrival times by F (2: half the request rate)",
    )
    w.add_argument(
        "--trace-block-tokens",
        type=int,
        default=DEFAULT_BLOCK_TOKENS,
        metavar="N",
        help=f"tokens per hash id of a Mooncake-style trace (default {DEFAULT_BLOCK_TOKENS})",
    )
    w.add_argument("--write-trace", metavar="FILE", help="write the workload as a trace, exit")
    chat = ChatWorkload()
    w.add_argument("--users", type=int, default=1000, help="chat users (default 1000)")
    w.add_argument("--turns", type=int, default=8, help="turns per user (default 8)")
    w.add_argument(
        "--concurrent-users", type=int, default=256, help="conversations open at once (256)"
    )
    w.add_argument("--system-tokens", type=int, default=1024, help="system prompt (1024)")
    w.add_argument("--system-prompts", type=int, default=1, help="distinct system prompts (1)")
    w.add_argument(
        "--user-tokens",
        default=f"{chat.user_tokens[0]},{chat.user_tokens[1]}",
        metavar="MIN,MAX",
        help="tokens per user message (default %(default)s)",
    )
    w.add_argument("--output-tokens", type=int, default=128, help="tokens per answer (128)")
    w.add_argument("--rate", type=float, default=5.0, help="requests per second (5)")
    w.add_argument("--seed", type=int, default=0, help="workload seed (0)")
    e = p.add_argument_group("engine")
    d = _DEFAULTS
    e.add_argument("--engine-tokens", type=int, default=d.engine_tokens, help="KV capacity, tokens")
    e.add_argument("--block-size", type=int, default=d.block_size, help="tokens per engine block")
    e.add_argument("--token-budget", type=int, default=d.token_budget, help="tokens per step")
    e.add_argument("--max-running", type=int, default=d.max_running, help="running requests")
    e.add_argument(
        "--decode-stride", type=int, default=d.decode_stride, help="tokens per decode step"
    )
    e.add_argument("--max-queue", type=int, default=d.max_queue, help="engine queue length")
    e.add_argument("--no-prefix-caching", action="store_true", help="engine prefix cache off")
    e.add_argument(
        "--kv-groups",
        metavar="GROUPS",
        help="KV cache groups of a hybrid model, e.g. full,5xwindow=1024 (default: full)",
    )
    r = p.add_argument_group("replicas")
    r.add_argument(
        "--replicas",
        type=int,
        default=1,
        metavar="N",
        help="N engine replicas, each its own engine, KV blocks, batching and GPU (default 1)",
    )
    r.add_argument(
        "--host-share",
        action="store_true",
        help="one host tier of --cpu-bytes shared by the replicas (default: each replica "
        "its own of --cpu-bytes / N: the same memory in all); host memory only",
    )
    r.add_argument(
        "--route",
        default="round-robin",
        choices=ROUTES,
        help="requests to replicas: round-robin (default) | sticky (a conversation stays "
        "on one replica)",
    )
    k = p.add_argument_group("kvoffload")
    k.add_argument(
        "--cpu-bytes", default="64GiB", help="host memory: 16GiB, 9139chunks, 5%% (64GiB; 0: off)"
    )
    for spec in LOWER_TIERS:
        k.add_argument(f"--{spec.name}-bytes", default="0", help=spec.sim.bytes_help)
    k.add_argument("--eviction", default=d.eviction, help=f"{' | '.join(policy_names())}")
    k.add_argument("--store-threshold", type=int, default=d.store_threshold, help="see docs")
    k.add_argument(
        "--lower-tier-admission", default=d.lower_tier_admission, help="write_through | N"
    )
    k.add_argument(
        "--lower-tier-loads",
        default=d.lower_tier_loads,
        help="direct (tier loads straight into the engine) | promote (through host memory)",
    )
    k.add_argument(
        "--chunk-tokens",
        type=int,
        help=f"tokens per chunk (default: a Mooncake trace's block, else {d.chunk_tokens})",
    )
    k.add_argument(
        "--load-policy",
        default=d.load_policy,
        help="cost (default: load a hit only where it beats recomputing) | always (every hit)",
    )
    c = p.add_argument_group("cost model")
    c.add_argument("--prefill-s-per-token", type=float, default=_COST.prefill_s_per_token)
    c.add_argument("--decode-s-per-token", type=float, default=_COST.decode_s_per_token)
    c.add_argument("--host-gbps", type=float, default=_COST.host_gbps, help=HOST.sim.gbps_help)
    for spec in LOWER_TIERS:
        c.add_argument(
            f"--{spec.name}-gbps",
            type=float,
            default=_COST.tier_gbps[spec.name],
            help=spec.sim.gbps_help,
        )
    c.add_argument(
        "--bytes-per-token",
        type=int,
        default=_COST.bytes_per_token,
        help="KV bytes per token: 2 x layers x kv_heads x head_dim x dtype bytes",
    )
    add_codec_arguments(k, c)
    o = p.add_argument_group("output")
    o.add_argument(
        "--sweep",
        nargs="?",
        const="auto",
        metavar="SIZES",
        help="host memory sizes (comma-separated, or auto) x every eviction policy",
    )
    o.add_argument(
        "--tier-bandwidth",
        metavar="GBPS",
        help="lower tiers' bandwidth (GB/s, comma-separated; every tier alike) x "
        "load_policy always, cost: "
        "mean time to first token against no kvoffload",
    )
    o.add_argument("--output", default="kvoffload-sweep.png", help="the sweep's PNG chart")
    o.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="sweep processes")
    o.add_argument(
        "--json", nargs="?", const="-", metavar="FILE", help="also write JSON (- or none: stdout)"
    )
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument(
        "--no-limits",
        action="store_true",
        help="skip the infinite-cache bound and the offline optimum (a first pass over the "
        "workload)",
    )
    return p


def workload_of(args: argparse.Namespace) -> Workload:
    if args.trace:
        return TraceFile(args.trace, args.head, args.time_scale, args.trace_block_tokens)
    for option, given in (
        ("--head", args.head is not None),
        ("--time-scale", args.time_scale != 1),
    ):
        if given:
            raise UsageError(f"{option}: needs --trace")
    try:
        lo, hi = (int(x) for x in args.user_tokens.split(","))
    except ValueError:
        raise UsageError(f"--user-tokens: expected MIN,MAX, got {args.user_tokens!r}") from None
    workload = ChatWorkload(
        users=args.users,
        turns=args.turns,
        system_tokens=args.system_tokens,
        user_tokens=(lo, hi),
        output_tokens=args.output_tokens,
        seed=args.seed,
    )
    return ChatTrace(workload, args.concurrent_users, args.rate, args.system_prompts)


def setup_of(args: argparse.Namespace) -> ReplicaSetup:
    """The replicas asked for (``--replicas``, ``--host-share``, ``--route``)."""
    return ReplicaSetup(args.replicas, args.host_share, args.route)


def chunk_tokens_of(args: argparse.Namespace, workload: Workload) -> int:
    """--chunk-tokens, by default a Mooncake trace's block (else the usual default)."""
    if args.chunk_tokens is not None:
        return int(args.chunk_tokens)
    if isinstance(workload, TraceFile) and workload.format == MOONCAKE:
        return workload.block_tokens
    return _DEFAULTS.chunk_tokens


def config_of(args: argparse.Namespace, chunk_tokens: int) -> SimConfig:
    """The settings without tier sizes (see :func:`sized`)."""
    admission: str | int = args.lower_tier_admission
    if admission != "write_through":
        try:
            admission = int(admission)
        except ValueError:
            raise UsageError(
                f"--lower-tier-admission: expected write_through or an integer, got {admission!r}"
            ) from None
    cost = CostModel(
        prefill_s_per_token=args.prefill_s_per_token,
        decode_s_per_token=args.decode_s_per_token,
        host_gbps=args.host_gbps,
        tier_gbps={spec.name: getattr(args, f"{spec.name}_gbps") for spec in LOWER_TIERS},
        bytes_per_token=args.bytes_per_token,
    )
    codecs, codec = codecs_of(args)
    return SimConfig(
        cpu_bytes=0,
        eviction=args.eviction,
        store_threshold=args.store_threshold,
        lower_tier_admission=admission,
        lower_tier_loads=args.lower_tier_loads,
        load_policy=args.load_policy,
        engine_tokens=args.engine_tokens,
        block_size=args.block_size,
        chunk_tokens=chunk_tokens,
        token_budget=args.token_budget,
        max_running=args.max_running,
        decode_stride=args.decode_stride,
        max_queue=args.max_queue,
        prefix_caching=not args.no_prefix_caching,
        cost=cost,
        kv_groups=parse_kv_groups(args.kv_groups) if args.kv_groups else ONE_GROUP,
        codecs=codecs,
        codec=codec,
    )


def sized(args: argparse.Namespace, config: SimConfig, refs: References | None) -> SimConfig:
    """``config`` with the tiers' sizes (bytes, chunks or shares of ``refs``' distinct
    chunks)."""
    units = ChunkUnits(config.chunk_bytes, refs.distinct if refs is not None else None)
    return replace(
        config,
        cpu_bytes=parse_size(args.cpu_bytes, "--cpu-bytes", units),
        tier_bytes={
            spec.name: parse_size(
                getattr(args, f"{spec.name}_bytes"), f"--{spec.name}-bytes", units
            )
            for spec in LOWER_TIERS
        },
    )


def capacity_chunks(config: SimConfig) -> int:
    """Chunk positions host memory holds (a hybrid model stores one chunk per group)."""
    return config.host_slots // len(config.kv_groups)
