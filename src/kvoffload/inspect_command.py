"""``kvoffload inspect``: what a disk tier directory or a Redis namespace holds, and
how a running engine's tiers are doing.

``kvoffload inspect disk PATH [...]`` reports, per namespace, the slab files' used
slots and capacity per rank, complete and incomplete chunks (as start-up recovery
counts them), bytes, payload sizes, format versions and slab files that are bad;
``kvoffload inspect redis URL [...]`` reports complete and incomplete chunks, values
per rank, bytes, payload sizes and format versions. ``--verify`` also reads every used
slot or value and checks it as the engine's readers do. ``kvoffload inspect metrics
URL`` reads a running engine's kvoffload counters from its Prometheus endpoint and
reports, per tier, chunks moved, failed, evicted and missing, hits, lookups and
integrity errors, host evictions without a lower-tier copy and the deferrals, the
cost model's lanes and each tier's load time per chunk and hit weight for routers. See
``docs/inspect.md``.

Read-only: inspect never creates, changes or deletes anything in a tier (the engine
clears or deletes bad copies itself); against a metrics endpoint it sends one GET.

Exit status of :func:`main`: 0 when the inspection ran (and, with ``--verify``, found
nothing bad); 1 when ``--verify`` found bad slots, slab files or values; ``inspect
metrics`` returns 0 whenever it read the endpoint, whatever the numbers. Usage errors
(bad arguments, a path that is not a kvoffload directory, an unreachable or refusing
server, a metrics URL that does not answer with Prometheus text holding kvoffload's
metrics) raise :class:`~kvoffload.core.errors.UsageError`, which ``kvoffload`` prints
as one line with exit status 2; ``--help`` exits 0 through ``SystemExit``.
"""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn

from kvoffload.core.errors import UsageError
from kvoffload.inspection import health_render
from kvoffload.inspection.arguments import namespace_hex, positive_int
from kvoffload.inspection.metrics_fetch import inspect_metrics
from kvoffload.inspection.model import Report
from kvoffload.inspection.render import to_json, to_text
from kvoffload.tiers.registry import TIERS, tier_spec

EXIT_OK = 0
EXIT_BAD = 1


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are :class:`UsageError` (one line, status 2)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def main(argv: list[str]) -> int:
    """Run ``kvoffload inspect`` with ``argv`` (the arguments after ``inspect``);
    print the report on stdout and return the exit status (module docstring)."""
    args = build_parser().parse_args(argv)
    if args.tier == "metrics":
        health = inspect_metrics(args.url, args.timeout_ms)
        text = health_render.to_json(health) + "\n" if args.json else health_render.to_text(health)
        sys.stdout.write(text)
        return EXIT_OK
    command = tier_spec(args.tier).inspect
    assert command is not None  # only tiers with a command have a subparser
    report: Report = command.run(args)
    sys.stdout.write(to_json(report) + "\n" if args.json else to_text(report))
    return EXIT_BAD if report.bad_total else EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvoffload inspect",
        description=(
            "Show what a kvoffload lower tier (a directory, a server) holds: "
            "chunks, bytes, namespaces, and with --verify an integrity check of every "
            "stored chunk; or, from a running engine's metrics endpoint, how each tier "
            "is doing. Read-only: nothing is changed or deleted."
        ),
        epilog=(
            "exit status: 0 fine, 1 --verify found bad slots, slab files or values, 2 usage error "
            "(bad arguments, not a kvoffload directory, server unreachable, not kvoffload's "
            "metrics)"
        ),
    )
    sub = parser.add_subparsers(dest="tier", required=True, metavar="WHAT")
    for spec in TIERS:
        command = spec.inspect
        if command is None:
            continue  # host memory: nothing to inspect offline
        tier = sub.add_parser(spec.name, help=command.help, description=command.description)
        command.add(tier)
        tier.add_argument(
            "--namespace",
            type=namespace_hex,
            metavar="HEX",
            help="only this namespace (its digest: 32 hex digits, as in the output)",
        )
        tier.add_argument("--verify", action="store_true", help=command.verify_help)
        tier.add_argument("--world-size", type=positive_int, metavar="N", help=command.world_help)
        tier.add_argument("--json", action="store_true", help="print JSON instead of tables")
    _add_metrics(sub)
    return parser


def _add_metrics(sub: argparse._SubParsersAction[_Parser]) -> None:
    metrics = sub.add_parser(
        "metrics",
        help="a running engine's Prometheus endpoint: the tiers' health",
        description="Read a running engine's kvoffload counters from its Prometheus "
        "endpoint (one HTTP GET) and show, per tier, chunks stored, spilled, promoted, "
        "loaded and failed, evictions, stores refused for want of room, hit tokens, "
        "lookups, integrity errors and missing chunks; host evictions without a "
        "lower-tier copy; lookup deferrals by reason; the load-or-recompute cost model "
        "and each tier's learned load time per chunk and hit weight for routers.",
    )
    metrics.add_argument(
        "url",
        metavar="URL",
        help="http://host:port[/path]: kvoffload's metrics_port endpoint "
        "(http://127.0.0.1:<port>) or vLLM's /metrics; without a scheme http:// is "
        "assumed, without a path /metrics",
    )
    metrics.add_argument(
        "--timeout-ms",
        type=positive_int,
        default=2000,
        metavar="MS",
        help="timeout for connecting and for reading the answer (default 2000)",
    )
    metrics.add_argument("--json", action="store_true", help="print JSON instead of a table")
