"""A :class:`~kvoffload.inspection.model.Report` as a table for people or as JSON.

The JSON document is ``dataclasses.asdict`` of the report (integer dict keys become
strings), plus ``shares`` per namespace and ``bad_total``; a namespace that was not
verified has no ``ok``/``bad``/``bad_examples``. ``chunks_per_group`` is always there;
the table shows it (column ``CHUNKS PER GROUP``, ``g<group>=<chunks>``) only when a
namespace has more than one KV cache group, so one-group tables read as before. A
disk namespace has the fields of :class:`~kvoffload.inspection.model.DiskNamespaceReport`
too. ``record`` is the namespace's recorded fields or null; the text form shows them
in a second table (``MODEL``, ``REVISION``, ``CONFIG`` and ``WEIGHTS`` digests,
``LAYOUT``, ``DTYPE``, ``PARALLEL``), "fields unknown" where there is no record. Both
forms are deterministic for a given report.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from kvoffload.inspection.model import DiskNamespaceReport, NamespaceReport, Report

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
_WHAT = {"disk": "slots", "redis": "values"}


_LEGACY_ZEROS = {"temporary_files": 0, "temporary_bytes": 0}
"""Kept in a Redis namespace's JSON (before ``vanished``, always 0) so that the Redis
document stays as it was when the disk tier still had temporary files."""


def to_json(report: Report) -> str:
    doc: dict[str, Any] = asdict(report)
    for i, (ns, entry) in enumerate(zip(report.namespaces, doc["namespaces"], strict=True)):
        entry["shares"] = ns.shares
        if not ns.verified:
            for name in ("ok", "bad", "bad_examples"):
                del entry[name]
        if report.tier == "redis":
            doc["namespaces"][i] = _insert_before(entry, "vanished", _LEGACY_ZEROS)
    doc["bad_total"] = report.bad_total
    return json.dumps(doc, indent=2)


def _insert_before(entry: dict[str, Any], key: str, extra: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in entry.items():
        if name == key:
            out.update(extra)
        out[name] = value
    return out


def to_text(report: Report) -> str:
    """The report as aligned tables and notes, ending with a newline."""
    what = _WHAT.get(report.tier, "shares")
    disks = [ns for ns in report.namespaces if isinstance(ns, DiskNamespaceReport)]
    out = [f"{report.tier} tier at {report.location} (read-only)"]
    if report.server is not None:
        out.append(_server_line(report.server))
    if not report.namespaces:
        out.append("no kvoffload namespaces found")
    elif report.tier == "disk":
        out += ["", *table(_with_groups(_disk_rows(disks), disks))]
    else:
        out += ["", *table(_with_groups(_share_rows(report.namespaces, what), report.namespaces))]
    if report.namespaces:
        out += ["", *table(_record_rows(report.namespaces), right=[False] * len(RECORD_HEAD))]
    if report.verified and report.namespaces:
        checked = "used slot" if report.tier == "disk" else what[:-1]
        rows = [["NAMESPACE", "OK", "BAD", "REASONS"]]
        for ns in report.namespaces:
            reasons = " ".join(f"{r}={n}" for r, n in ns.bad.items()) or "-"
            rows.append([ns.namespace, str(ns.ok), str(sum(ns.bad.values())), reasons])
        out += ["", f"verify: every {checked} read in full and checked", *table(rows)]
        for ns in report.namespaces:
            bad_shares = sum(ns.bad.values())
            for bad in ns.bad_examples:
                out.append(f"  bad: {bad.name}: {bad.detail}")
            if bad_shares > len(ns.bad_examples):
                more = bad_shares - len(ns.bad_examples)
                out.append(f"  ... and {more} more in {ns.namespace}")
    notes = [f"bad slab: {bad.name}: {bad.detail}" for ns in disks for bad in ns.bad_slabs]
    notes += [_vanished_note(ns, report.tier, what) for ns in report.namespaces if ns.vanished]
    notes += [
        f"note: {ns.namespace}: {ns.duplicate_slots} complete slots hold a chunk that "
        "another slot holds too (start-up recovery keeps the newest copy)"
        for ns in disks
        if ns.duplicate_slots
    ]
    if report.stray:
        shown = ", ".join(report.stray_examples)
        etc = ", ..." if report.stray > len(report.stray_examples) else ""
        things = "slab files" if report.tier == "disk" else f"chunk {what}"
        notes.append(f"note: {report.stray} stray names that are not {things}: {shown}{etc}")
    out += ["", *notes] if notes else []
    out += [f"warning: {w}" for w in report.warnings]
    if report.verified:
        out.append(_result_line(report, disks, what))
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


def _share_rows(namespaces: list[NamespaceReport], what: str) -> list[list[str]]:
    rows = [
        [
            "NAMESPACE",
            "CHUNKS",
            "INCOMPLETE",
            f"{what.upper()} PER RANK",
            "BYTES",
            "PAYLOAD",
            "VERSION",
        ]
    ]
    for ns in namespaces:
        per_rank = " ".join(f"r{rank}={n}" for rank, n in ns.shares_per_rank.items()) or "-"
        rows.append(
            [
                ns.namespace,
                str(ns.complete_chunks),
                str(ns.incomplete_chunks),
                per_rank,
                human_bytes(ns.bytes),
                _payloads(ns),
                _versions(ns),
            ]
        )
    if len(namespaces) > 1:
        rows.append(
            [
                "total",
                str(sum(ns.complete_chunks for ns in namespaces)),
                str(sum(ns.incomplete_chunks for ns in namespaces)),
                str(sum(ns.shares for ns in namespaces)),
                human_bytes(sum(ns.bytes for ns in namespaces)),
                "",
                "",
            ]
        )
    return rows


RECORD_HEAD = ["NAMESPACE", "MODEL", "REVISION", "CONFIG", "WEIGHTS", "LAYOUT", "DTYPE", "PARALLEL"]
UNKNOWN_FIELDS = "fields unknown (no namespace record)"


def _record_rows(namespaces: Sequence[NamespaceReport]) -> list[list[str]]:
    """One row per namespace with the fields its record names (``model@revision``
    split in two), or :data:`UNKNOWN_FIELDS`."""
    rows = [RECORD_HEAD]
    for ns in namespaces:
        record = ns.record
        if record is None:
            rows.append([ns.namespace, UNKNOWN_FIELDS, *[""] * (len(RECORD_HEAD) - 2)])
            continue
        model, _, revision = record["model"].rpartition("@")
        if not model:
            model, revision = revision, "-"
        rows.append(
            [
                ns.namespace,
                model,
                revision,
                record["config"] or "-",
                record["weights"] or "-",
                record["layout"],
                record["dtype"],
                record["parallel"],
            ]
        )
    return rows


def _disk_rows(namespaces: list[DiskNamespaceReport]) -> list[list[str]]:
    rows = [
        [
            "NAMESPACE",
            "CHUNKS",
            "INCOMPLETE",
            "USED SLOTS PER RANK",
            "USED",
            "CAPACITY",
            "PAYLOAD",
            "VERSION",
        ]
    ]
    for ns in namespaces:
        cells = {r: f"r{r}={ns.shares_per_rank[r]}/{n}" for r, n in ns.slots_per_rank.items()}
        for bad in ns.bad_slabs:
            cells.setdefault(bad.rank, f"r{bad.rank}=bad")
        rows.append(
            [
                ns.namespace,
                str(ns.complete_chunks),
                str(ns.incomplete_chunks),
                " ".join(cells[r] for r in sorted(cells)) or "-",
                human_bytes(ns.bytes),
                human_bytes(ns.capacity_bytes),
                _payloads(ns),
                _versions(ns),
            ]
        )
    if len(namespaces) > 1:
        used = sum(ns.shares for ns in namespaces)
        slots = sum(sum(ns.slots_per_rank.values()) for ns in namespaces)
        rows.append(
            [
                "total",
                str(sum(ns.complete_chunks for ns in namespaces)),
                str(sum(ns.incomplete_chunks for ns in namespaces)),
                f"{used}/{slots}",
                human_bytes(sum(ns.bytes for ns in namespaces)),
                human_bytes(sum(ns.capacity_bytes for ns in namespaces)),
                "",
                "",
            ]
        )
    return rows


def _with_groups(rows: list[list[str]], namespaces: Sequence[NamespaceReport]) -> list[list[str]]:
    """``rows`` (a header, one row per namespace, maybe a total) with the column of
    complete chunks per KV cache group after ``INCOMPLETE``, when a namespace has more
    than one group; else ``rows`` unchanged."""
    if all(len(ns.chunks_per_group) <= 1 for ns in namespaces):
        return rows
    cells = ["CHUNKS PER GROUP"]
    cells += [" ".join(f"g{g}={n}" for g, n in ns.chunks_per_group.items()) for ns in namespaces]
    cells += [""] * (len(rows) - len(cells))  # the total row
    return [[*row[:3], cell, *row[3:]] for row, cell in zip(rows, cells, strict=True)]


def _payloads(ns: NamespaceReport) -> str:
    return ",".join(human_bytes(n) for n in ns.payload_bytes) or "-"


def _versions(ns: NamespaceReport) -> str:
    versions = ns.format_versions
    if len(versions) == 1:
        return next(iter(versions))
    return " ".join(f"{v}:{n}" for v, n in versions.items()) or "-"


def _vanished_note(ns: NamespaceReport, tier: str, what: str) -> str:
    if tier == "disk":
        return f"note: {ns.namespace}: {ns.vanished} slab files vanished while inspecting"
    return (
        f"note: {ns.namespace}: {ns.vanished} {what} vanished while inspecting "
        "(evicted or deleted meanwhile)"
    )


def _result_line(report: Report, disks: list[DiskNamespaceReport], what: str) -> str:
    bad = sum(sum(ns.bad.values()) for ns in report.namespaces)
    shares = sum(ns.shares for ns in report.namespaces)
    slabs = sum(len(ns.bad_slabs) for ns in disks)
    if not bad and not slabs:
        return f"result: all {what} verified OK"
    line = f"result: {bad} of {shares} {what} bad"
    return line + (f", {slabs} slab files bad" if slabs else "")


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


def table(rows: list[list[str]], right: list[bool] | None = None) -> list[str]:
    """Columns padded to their widest cell; right-aligned (header included) where
    ``right`` says, by default the columns whose cells (header aside) are all numbers."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    numeric = (
        right
        if right is not None
        else [all(r[i].isdigit() for r in rows[1:] if r[i]) for i in range(len(widths))]
    )
    lines = []
    for row in rows:
        cells = [
            cell.rjust(width) if num else cell.ljust(width)
            for cell, width, num in zip(row, widths, numeric, strict=True)
        ]
        lines.append("  ".join(cells).rstrip())
    return lines
