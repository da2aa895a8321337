"""``kvoffload simulate``: the run (or the sweep) and the printed report; the
arguments are :mod:`kvoffload.simulate.arguments`'s.

``main(argv)`` returns the exit status; bad arguments, a bad trace line or a
workload the engine cannot hold raise :class:`~kvoffload.core.errors.UsageError`
(or ConfigError), which ``kvoffload`` prints as one line (exit status 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kvoffload.core.errors import UsageError
from kvoffload.core.policies import policy_names
from kvoffload.simulate.arguments import (
    build_parser,
    capacity_chunks,
    chunk_tokens_of,
    config_of,
    setup_of,
    sized,
    workload_of,
)
from kvoffload.simulate.bandwidth_sweep import (
    bandwidth_json,
    format_bandwidth_sweep,
    parse_gbps_list,
    run_bandwidth_sweep,
)
from kvoffload.simulate.optimum import bounds, chunk_references, infinite_hit_tokens
from kvoffload.simulate.replica_report import format_replicas
from kvoffload.simulate.replicas import run_replicas
from kvoffload.simulate.report import format_report
from kvoffload.simulate.report_limits import behind_warning
from kvoffload.simulate.runner import run_simulation
from kvoffload.simulate.settings import SimConfig
from kvoffload.simulate.sweep import (
    Workload,
    auto_sizes,
    format_sweep,
    plot_sweep,
    run_sweep,
    sweep_json,
)
from kvoffload.simulate.trace import TraceSummary, write_trace
from kvoffload.simulate.units import ChunkUnits, format_bytes, is_share, parse_size_list


def _progress(total: int, unit: str, enabled: bool) -> tuple[Callable[[int], None], Any]:
    from tqdm import tqdm

    bar = tqdm(total=total, unit=unit, file=sys.stderr, disable=not enabled, leave=False)
    return bar.update, bar


def _emit(text: str, data: Any, json_to: str | None) -> None:
    """Print the report (to stderr when the JSON goes to stdout) and the JSON."""
    print(text, file=sys.stderr if json_to == "-" else sys.stdout)
    if json_to is None:
        return
    encoded = json.dumps(data, indent=2, sort_keys=True)
    if json_to == "-":
        print(encoded)
        return
    try:
        with open(json_to, "w", encoding="utf-8") as out:
            out.write(encoded + "\n")
    except OSError as exc:
        raise UsageError(f"--json: cannot write {json_to}: {exc.strerror or exc}") from None


def main(argv: list[str]) -> int:
    """Run ``kvoffload simulate`` with ``argv`` (the arguments after ``simulate``)."""
    args = build_parser().parse_args(argv)
    setup = setup_of(args)
    workload = workload_of(args)
    if args.write_trace:
        try:
            with open(args.write_trace, "w", encoding="utf-8") as out:
                count = write_trace(workload.requests(), out)
        except OSError as exc:
            raise UsageError(f"cannot write {args.write_trace}: {exc.strerror or exc}") from None
        print(f"wrote {count} requests ({workload.describe()}) to {args.write_trace}")
        return 0
    config = config_of(args, chunk_tokens_of(args, workload))
    # validates a trace file before simulating
    capacity = config.request_capacity
    summary = workload.summary(capacity if capacity is not None else 2**62)
    _check_fits(summary, config)
    tier_sizes = [getattr(args, f"{name}_bytes") for name in config.tier_bytes]
    sizes_given = (args.cpu_bytes, *tier_sizes, args.sweep or "")
    wants_refs = not args.no_limits or any(is_share(text) for text in sizes_given)
    refs = (
        chunk_references(workload.requests(), config.chunk_tokens, config.block_size)
        if wants_refs
        else None
    )
    config = sized(args, config, refs)
    _check_host(config)
    show = not args.no_progress and sys.stderr.isatty()
    if args.tier_bandwidth is not None:
        if setup.replicas > 1:
            raise UsageError("--replicas and --tier-bandwidth: one replica per sweep only")
        return _bandwidth_sweep(args, config, workload, show)
    infinite = infinite_hit_tokens(refs) if refs is not None and not args.no_limits else None
    if setup.replicas > 1:
        if args.sweep is not None:
            raise UsageError("--replicas and --sweep: one replica per sweep point only")
        update, bar = _progress(summary.requests, "req", show)
        with bar:
            replicas = run_replicas(config, setup, workload.requests(), update)
        if refs is not None and infinite is not None:
            replicas.total.bounds = bounds(refs, capacity_chunks(config), infinite)
        header = f"Workload: {workload.describe()}\n"
        _emit(header + format_replicas(replicas), replicas.as_json(), args.json)
        return 0
    if args.sweep is None:
        update, bar = _progress(summary.requests, "req", show)
        with bar:
            result = run_simulation(config, workload.requests(), update)
        if refs is not None and infinite is not None:
            result.bounds = bounds(refs, capacity_chunks(config), infinite)
        header = f"Workload: {workload.describe()}\n"
        _emit(header + format_report(result), result.as_json(), args.json)
        return 0
    if args.jobs < 1:
        raise UsageError("--jobs: must be an integer >= 1")
    if args.sweep == "auto":
        sizes = auto_sizes(summary.unique_tokens * config.cost.bytes_per_token, config.chunk_bytes)
    else:
        units = ChunkUnits(config.chunk_bytes, refs.distinct if refs is not None else None)
        sizes = parse_size_list(args.sweep, "--sweep", units)
    update, bar = _progress(len(sizes) * len(policy_names()), "sim", show)
    with bar:
        points = run_sweep(config, workload, sizes, jobs=args.jobs, progress=update)
    if refs is not None and infinite is not None:
        limits = {
            s: bounds(refs, capacity_chunks(replace(config, cpu_bytes=s)), infinite) for s in sizes
        }
        for point in points:
            point.result.bounds = limits[point.cpu_bytes]
    title = workload.describe()
    try:
        plot_sweep(points, args.output, title)
    except OSError as exc:
        raise UsageError(f"--output: cannot write {args.output}: {exc.strerror or exc}") from None
    behind = [
        w
        for p in points
        if (w := behind_warning(p.result.late_ttft_p50_s, p.result.trace_span_s)) is not None
    ]
    text = f"Workload: {title}\n{format_sweep(points)}\n\nwrote the chart to {args.output}"
    if behind:  # the first one's, and how many
        text = f"{behind[0]} ({len(behind)} of {len(points)} runs)\n\n{text}"
    _emit(text, sweep_json(points), args.json)
    return 0


def _bandwidth_sweep(
    args: argparse.Namespace, config: SimConfig, workload: Workload, show: bool
) -> int:
    if args.sweep is not None:
        raise UsageError("--tier-bandwidth and --sweep: one sweep at a time")
    if args.jobs < 1:
        raise UsageError("--jobs: must be an integer >= 1")
    bandwidths = parse_gbps_list(args.tier_bandwidth)
    update, bar = _progress(1 + 2 * len(bandwidths), "sim", show)
    with bar:
        baseline, points = run_bandwidth_sweep(
            config, workload, bandwidths, jobs=args.jobs, progress=update
        )
    text = f"Workload: {workload.describe()}\n{format_bandwidth_sweep(baseline, points)}"
    _emit(text, bandwidth_json(baseline, points), args.json)
    return 0


def _check_fits(summary: TraceSummary, config: SimConfig) -> None:
    if summary.requests == 0:
        raise UsageError("the workload has no requests")
    if config.too_large(summary.max_request_tokens) is not None:
        capacity = config.request_capacity
        holds = f"{config.engine_tokens} tokens" if not config.hybrid else f"{capacity} tokens"
        raise UsageError(
            f"a request needs {summary.max_request_tokens} tokens of KV, more than the engine "
            f"holds ({holds}); raise --engine-tokens"
        )
    windows = [g.window for g in config.kv_groups.groups if g.window is not None]
    if windows and config.chunk_tokens > min(windows):
        print(
            f"note: --chunk-tokens {config.chunk_tokens} exceeds the smallest window "
            f"({min(windows)}): a window group's chunk finished over several steps has lost "
            "its first blocks and is not stored (see docs/simulate.md)",
            file=sys.stderr,
        )


def _check_host(config: SimConfig) -> None:
    chunk = config.tier_codecs["host"].chunk_bytes  # as host memory holds it
    if 0 < config.cpu_bytes < chunk:
        print(
            f"note: --cpu-bytes {format_bytes(config.cpu_bytes)} is less than one chunk "
            f"({format_bytes(chunk)}): kvoffload is off",
            file=sys.stderr,
        )
