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
integrity errors, host evictions without a lower-tier copy and the deferrals. See
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
import os
import sys
from pathlib import Path
from typing import NoReturn

from kvoffload.core.errors import UsageError
from kvoffload.inspection import health_render
from kvoffload.inspection.disk_scan import inspect_disk
from kvoffload.inspection.metrics_fetch import inspect_metrics
from kvoffload.inspection.model import Report, is_digest_hex
from kvoffload.inspection.redis_scan import inspect_redis
from kvoffload.inspection.render import to_json, to_text

EXIT_OK = 0
EXIT_BAD = 1
PASSWORD_ENV = "REDISCLI_AUTH"


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
    report: Report
    if args.tier == "disk":
        report = inspect_disk(Path(args.path), args.namespace, args.verify, args.world_size)
    else:
        report = inspect_redis(
            args.url,
            namespace=args.namespace,
            verify=args.verify,
            world_size=args.world_size,
            cluster=args.cluster,
            username=args.username,
            password=args.password if args.password is not None else os.environ.get(PASSWORD_ENV),
            timeout_ms=args.timeout_ms,
        )
    sys.stdout.write(to_json(report) + "\n" if args.json else to_text(report))
    return EXIT_BAD if report.bad_total else EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="kvoffload inspect",
        description=(
            "Show what a kvoffload disk tier directory or Redis/Valkey server holds: "
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
    disk = sub.add_parser(
        "disk",
        help="a disk tier directory",
        description="Inspect a disk tier directory (read-only): the slab file of each "
        "namespace and rank, its used slots and capacity, complete chunks (every rank "
        "holds the chunk in the same slot, as start-up recovery requires) and bad slab files.",
    )
    disk.add_argument(
        "path",
        metavar="PATH",
        help="the tier's directory (the one holding kvoffload-v1/), kvoffload-v1/ "
        "itself, or one namespace directory",
    )
    redis = sub.add_parser(
        "redis",
        help="a Redis/Valkey server or cluster",
        description="Inspect kvoffload's values in a Redis/Valkey server (read-only: "
        "SCAN, STRLEN, GETRANGE, GET, INFO).",
    )
    redis.add_argument(
        "url",
        metavar="URL",
        help="redis://[user:password@]host:port[/db] or rediss://... (TLS; certificates "
        "in the query, e.g. ?ssl_ca_certs=/etc/ca.pem), as the tier's redis_url",
    )
    redis.add_argument("--cluster", action="store_true", help="URL names a Redis Cluster node")
    redis.add_argument("--username", help="ACL user (overrides the URL's)")
    redis.add_argument(
        "--password",
        help=f"password (overrides the URL's); default: ${PASSWORD_ENV} when set",
    )
    redis.add_argument(
        "--timeout-ms",
        type=_positive,
        default=2000,
        metavar="MS",
        help="timeout for connecting and for every command (default 2000)",
    )
    verify_help = {
        disk: "read every used slot in full and check header and checksum, as the disk "
        "tier's reader does; exit status 1 if any slot or slab file is bad",
        redis: "read every file or value in full and check header and checksum; "
        "exit status 1 if any is bad",
    }
    world_help = {
        disk: "ranks per chunk (a chunk is complete when ranks 0..N-1 all hold it in "
        "the same slot); default: the highest rank of a slab file + 1",
        redis: "ranks per chunk (a chunk is complete when ranks 0..N-1 are all there); "
        "default: the highest rank seen + 1",
    }
    for tier in (disk, redis):
        tier.add_argument(
            "--namespace",
            type=_namespace,
            metavar="HEX",
            help="only this namespace (its digest: 32 hex digits, as in the output)",
        )
        tier.add_argument("--verify", action="store_true", help=verify_help[tier])
        tier.add_argument("--world-size", type=_positive, metavar="N", help=world_help[tier])
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
        "lower-tier copy; lookup deferrals by reason.",
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
        type=_positive,
        default=2000,
        metavar="MS",
        help="timeout for connecting and for reading the answer (default 2000)",
    )
    metrics.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _namespace(text: str) -> str:
    value = text.lower()
    if not is_digest_hex(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a namespace digest (32 hex digits)")
    return value


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value
