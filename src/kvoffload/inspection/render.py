"""A :class:`~kvoffload.inspection.model.Report` as a table for people or as JSON.

The JSON document is ``dataclasses.asdict`` of the report (integer dict keys become
strings), plus ``shares`` per namespace and ``bad_total``; a namespace that was not
verified has no ``ok``/``bad``/``bad_examples``. Both forms are deterministic for a
given report.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from kvoffload.inspection.model import NamespaceReport, Report

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_WHAT = {"disk": "files", "redis": "values"}


def to_json(report: Report) -> str:
    doc: dict[str, Any] = asdict(report)
    for ns, entry in zip(report.namespaces, doc["namespaces"], strict=True):
        entry["shares"] = ns.shares
        if not ns.verified:
            for name in ("ok", "bad", "bad_examples"):
                del entry[name]
    doc["bad_total"] = report.bad_total
    return json.dumps(doc, indent=2)


def to_text(report: Report) -> str:
    """The report as aligned tables and notes, ending with a newline."""
    what = _WHAT.get(report.tier, "shares")
    out = [f"{report.tier} tier at {report.location} (read-only)"]
    if report.server is not None:
        out.append(_server_line(report.server))
    if not report.namespaces:
        out.append("no kvoffload namespaces found")
    else:
        rows = [
            [
                "NAMESPACE",
                "CHUNKS",
                "INCOMPLETE",
                f"{what.upper()} PER RANK",
                "BYTES",
                "PAYLOAD",
                "VERSION",
                "TEMPORARY",
            ]
        ]
        rows += [_row(ns) for ns in report.namespaces]
        if len(report.namespaces) > 1:
            rows.append(_total_row(report.namespaces))
        if report.tier != "disk":  # only the disk tier writes temporary files
            rows = [row[:-1] for row in rows]
        out += ["", *_table(rows)]
    if report.verified and report.namespaces:
        rows = [["NAMESPACE", "OK", "BAD", "REASONS"]]
        for ns in report.namespaces:
            reasons = " ".join(f"{r}={n}" for r, n in ns.bad.items()) or "-"
            rows.append([ns.namespace, str(ns.ok), str(ns.bad_total), reasons])
        out += ["", f"verify: every {what[:-1]} read in full and checked", *_table(rows)]
        for ns in report.namespaces:
            for bad in ns.bad_examples:
                out.append(f"  bad: {bad.name}: {bad.detail}")
            if ns.bad_total > len(ns.bad_examples):
                more = ns.bad_total - len(ns.bad_examples)
                out.append(f"  ... and {more} more in {ns.namespace}")
    notes = [
        f"note: {ns.namespace}: {ns.vanished} {what} vanished while inspecting "
        "(evicted or deleted meanwhile)"
        for ns in report.namespaces
        if ns.vanished
    ]
    if report.stray:
        shown = ", ".join(report.stray_examples)
        etc = ", ..." if report.stray > len(report.stray_examples) else ""
        notes.append(f"note: {report.stray} stray names that are not chunk {what}: {shown}{etc}")
    out += ["", *notes] if notes else []
    out += [f"warning: {w}" for w in report.warnings]
    if report.verified:
        total, shares = report.bad_total, sum(ns.shares for ns in report.namespaces)
        out.append(
            f"result: {total} of {shares} {what} bad"
            if total
            else f"result: all {what} verified OK"
        )
    return "\n".join(out) + "\n"


def human_bytes(n: int) -> str:
    """``n`` in binary units: ``"512 B"``, ``"56.0 KiB"``."""
    if n < 1024:
        return f"{n} B"
    value, unit = float(n), 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    return f"{value:.1f} {_UNITS[unit]}"


def _row(ns: NamespaceReport) -> list[str]:
    per_rank = " ".join(f"r{rank}={n}" for rank, n in ns.shares_per_rank.items()) or "-"
    payload = ",".join(human_bytes(n) for n in ns.payload_bytes) or "-"
    versions = ns.format_versions
    version = (
        next(iter(versions))
        if len(versions) == 1
        else " ".join(f"{v}:{n}" for v, n in versions.items()) or "-"
    )
    tmp = str(ns.temporary_files)
    if ns.temporary_files:
        tmp += f" ({human_bytes(ns.temporary_bytes)})"
    return [
        ns.namespace,
        str(ns.complete_chunks),
        str(ns.incomplete_chunks),
        per_rank,
        human_bytes(ns.bytes),
        payload,
        version,
        tmp,
    ]


def _total_row(namespaces: list[NamespaceReport]) -> list[str]:
    tmp = sum(ns.temporary_files for ns in namespaces)
    tmp_bytes = sum(ns.temporary_bytes for ns in namespaces)
    return [
        "total",
        str(sum(ns.complete_chunks for ns in namespaces)),
        str(sum(ns.incomplete_chunks for ns in namespaces)),
        str(sum(ns.shares for ns in namespaces)),
        human_bytes(sum(ns.bytes for ns in namespaces)),
        "",
        "",
        f"{tmp} ({human_bytes(tmp_bytes)})" if tmp else "0",
    ]


def _server_line(server: dict[str, str | int]) -> str:
    limit = int(server.get("maxmemory", 0))
    parts = [
        f"maxmemory {human_bytes(limit) if limit else '0 (no limit)'}",
        f"maxmemory-policy {server.get('maxmemory_policy', 'unknown')}",
    ]
    if "used_memory" in server:
        parts.append(f"used memory {human_bytes(int(server['used_memory']))}")
    nodes = int(server.get("nodes", 1))
    return "server: " + ", ".join(parts) + (f" (over {nodes} primaries)" if nodes > 1 else "")


def _table(rows: list[list[str]]) -> list[str]:
    """Columns padded to their widest cell; numbers right-aligned (header included)."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    numeric = [all(r[i].isdigit() for r in rows[1:] if r[i]) for i in range(len(widths))]
    lines = []
    for row in rows:
        cells = [
            cell.rjust(width) if num else cell.ljust(width)
            for cell, width, num in zip(row, widths, numeric, strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    return lines
