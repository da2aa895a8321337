"""Inspect a disk tier directory, read-only.

The layout is :mod:`kvoffload.tiers.disk`'s:
``<root>/kvoffload-v1/<namespace digest hex>/<key hex[:2]>/<key hex>.r<rank>``, plus
temporary files (``<final name>.tmp.<pid>.<n>``) of writes in progress or interrupted.
A file is the header block (``PAYLOAD_OFFSET`` bytes: the header, zero-padded) and
the payload, zero-padded to ``file_bytes``; a file is accepted at any size from the
end of its payload to that padded size, as the tier's reader accepts it.
Files are opened read-only; nothing is created, renamed, changed or deleted
(temporary and bad files are only counted: the engine sweeps the former at start and
deletes the latter when it reads them). Reading may update access times, which
kvoffload does not use.

Entries are visited in name order, so the listed examples are deterministic. A file
that disappears between the listing and the read (the engine evicting it) counts as
*vanished*. Anything under ``kvoffload-v1/`` that is not a namespace directory, a
fan-out directory, a share or a temporary file counts as *stray* (a share whose
fan-out directory does not match its key included: the engine would never find it).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from kvoffload.core.chunk_format import HEADER_BYTES
from kvoffload.core.errors import UsageError
from kvoffload.core.keys import ChunkKey
from kvoffload.inspection.model import (
    MAX_RANK,
    FirstNames,
    NamespaceTally,
    Report,
    check_stored,
    header_fields,
    is_digest_hex,
)
from kvoffload.tiers.disk import FORMAT_DIR, PAYLOAD_OFFSET, file_bytes

TMP_MARKER = ".tmp."
"""What marks a temporary file's name (``kvoffload.tiers.disk`` writes ``.tmp.<pid>.<n>``)."""


def inspect_disk(path: Path, namespace: str | None, verify: bool, world_size: int | None) -> Report:
    """What the disk tier directory at ``path`` holds: every namespace, or only
    ``namespace`` (32 hex digits). ``path`` may be the tier's root (the directory
    holding ``kvoffload-v1/``), ``kvoffload-v1/`` itself or one namespace directory.
    With ``verify`` every share is read in full and checked (:func:`check_stored`).

    Raises :class:`UsageError` when ``path`` is not such a directory or the namespace
    is not there; ``OSError`` when a directory cannot be listed.
    """
    root, implied = resolve_root(path)
    if namespace and implied and namespace != implied:
        raise UsageError(f"{path} is namespace {implied}, not {namespace}")
    namespace = namespace or implied
    base = root / FORMAT_DIR
    stray = FirstNames()
    digests: list[str] = []
    for entry in sorted(os.scandir(base), key=lambda e: e.name):
        if entry.is_dir(follow_symlinks=False) and is_digest_hex(entry.name):
            digests.append(entry.name)
        else:
            stray.add(f"{FORMAT_DIR}/{entry.name}")
    if namespace is not None:
        if namespace not in digests:
            present = ", ".join(digests[:3]) + (", ..." if len(digests) > 3 else "")
            raise UsageError(
                f"no namespace {namespace} under {base} (present: {present or 'none'})"
            )
        digests = [namespace]
        stray = FirstNames()  # only the chosen namespace is reported
    tallies = [_scan_namespace(root, digest, verify, stray) for digest in digests]
    return Report(
        tier="disk",
        location=str(root),
        verified=verify,
        namespaces=[tally.report(world_size) for tally in tallies],
        stray=stray.count,
        stray_examples=[name for name, _ in stray.first()],
    )


def resolve_root(path: Path) -> tuple[Path, str | None]:
    """The tier root ``path`` names, and the namespace it names if it is a namespace
    directory. :class:`UsageError` for anything else."""
    if not path.exists():
        raise UsageError(f"{path}: no such directory")
    if not path.is_dir():
        raise UsageError(f"{path}: not a directory")
    if (path / FORMAT_DIR).is_dir():
        return path, None
    if path.name == FORMAT_DIR:
        return path.parent, None
    if path.parent.name == FORMAT_DIR and is_digest_hex(path.name):
        return path.parent.parent, path.name
    raise UsageError(f"{path}: not a kvoffload disk tier directory (no {FORMAT_DIR}/ inside)")


def _scan_namespace(root: Path, digest_hex: str, verify: bool, stray: FirstNames) -> NamespaceTally:
    tally = NamespaceTally(digest_hex, verify)
    digest = bytes.fromhex(digest_hex)
    rel = f"{FORMAT_DIR}/{digest_hex}"
    for sub in sorted(os.scandir(root / rel), key=lambda e: e.name):
        name = f"{rel}/{sub.name}"
        if not (sub.is_dir(follow_symlinks=False) and _is_fanout(sub.name)):
            stray.add(name)
            continue
        for entry in sorted(os.scandir(sub.path), key=lambda e: e.name):
            _scan_file(
                entry,
                f"{name}/{entry.name}",
                fanout=sub.name,
                digest=digest,
                tally=tally,
                stray=stray,
            )
    return tally


def _scan_file(
    entry: os.DirEntry[str],
    name: str,
    *,
    fanout: str,
    digest: bytes,
    tally: NamespaceTally,
    stray: FirstNames,
) -> None:
    if TMP_MARKER in entry.name:
        with contextlib.suppress(FileNotFoundError):  # renamed or removed meanwhile
            tally.add_temporary(entry.stat(follow_symlinks=False).st_size)
        return
    parsed = parse_file_name(entry.name)
    if parsed is None or parsed[0].hex()[:2] != fanout or not entry.is_file(follow_symlinks=False):
        stray.add(name)
        return
    key, rank = parsed
    try:
        with open(entry.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = f.read(HEADER_BYTES)
            fields = header_fields(data)
            if tally.verify and fields is not None:  # at most one byte past the longest
                data += f.read(file_bytes(fields[1]) + 1 - HEADER_BYTES)  # valid file
    except FileNotFoundError:
        tally.add_vanished()
        return
    except OSError as exc:
        tally.add(
            key, rank, name, size=0, header=None, failure=("unreadable", f"unreadable: {exc}")
        )
        return
    failure = None
    if tally.verify:
        error = check_stored(
            data, digest, key, rank, payload_offset=PAYLOAD_OFFSET, max_bytes=file_bytes
        )
        failure = None if error is None else (error.reason.value, str(error))
    tally.add(key, rank, name, size=size, header=data[:HEADER_BYTES], failure=failure)


def parse_file_name(name: str) -> tuple[ChunkKey, int] | None:
    """``(key, rank)`` of a share's file name (``<key hex>.r<rank>``, exactly as the
    disk tier writes it); None for any other name."""
    hexkey, sep, rank = name.partition(".r")
    if not (sep and is_digest_hex(hexkey) and rank.isascii() and rank.isdigit()):
        return None
    if str(int(rank)) != rank or int(rank) > MAX_RANK:
        return None
    return ChunkKey(bytes.fromhex(hexkey)), int(rank)


def _is_fanout(name: str) -> bool:
    return len(name) == 2 and all(c in "0123456789abcdef" for c in name)
