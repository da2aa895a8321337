"""Inspect a disk tier directory, read-only.

The layout is :mod:`kvoffload.tiers.disk`'s: one preallocated slab file per namespace
and rank, ``<root>/kvoffload-v1/<namespace digest hex>/slab.r<rank>``. A slab is a
4 KiB superblock (:mod:`kvoffload.tiers.slab_format`: namespace digest, rank, payload
size, number of slots) and fixed-size slots; a slot is a 4 KiB header block (the chunk
header, the chunk key and a write sequence number, zero-padded) and the payload,
zero-padded to whole pages. A slot whose header and key are all zero (never written,
or cleared by the engine after a failed read) is empty; any other slot is *used*.

Chunks are counted as start-up recovery (:mod:`kvoffload.tiers.disk_index`) counts
them, from headers only: a slot is *complete* when every rank ``0 .. N-1`` has a slab
whose header in that slot is valid (namespace, storage key ``shard_key(key, rank)``,
the slab's payload size) and names the same chunk key. A chunk complete in several
slots counts once (the other slots are *duplicates*; recovery keeps the newest); a
chunk named by a valid header but complete nowhere is *incomplete*. With ``verify``
every used slot is also read whole and checked as the engine's reader checks it
(:func:`~kvoffload.inspection.checks.check_slot`); that changes none of the counts.
Complete chunks are also counted by the KV cache group their headers name
(:mod:`~kvoffload.inspection.groups`).

Cost: one ``pread`` of a slot's first 88 bytes per slot and slab, slot by slot, with
readahead off for the file so payloads are not read; with ``verify`` a second
``pread`` of the header block and payload of each used slot. Memory: one key per
complete chunk, and one per chunk of a KV cache group other than 0.

A slab file whose superblock is unreadable, or names another namespace or rank, is
reported as a bad slab and not scanned. One shorter than its superblock says is
reported as bad (``short``) and scanned as far as it goes: slots past the end read
as empty, as recovery reads them. Anything under ``kvoffload-v1/`` that is not a
namespace directory, a slab file (a regular file named exactly ``slab.r<rank>``,
rank in ASCII digits without leading zeros) or a namespace's record (a regular file
``namespace.json``: :mod:`kvoffload.tiers.disk_record`, shown as the namespace's
fields) counts as *stray*, except a namespace's lock and users files
(``kvoffload.tiers.disk_lock``: never locked or opened here, so inspecting a tier an
engine is using works), the fan-out
directories of the former one-file-per-chunk layout included: the engine never reads
them. Entries are visited in name order and slots in order, so reports are
deterministic.

Files are opened ``O_RDONLY`` (``O_NOFOLLOW``); nothing is created, changed or
deleted. Reading may update access times, which kvoffload does not use.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from pathlib import Path

from kvoffload.core.errors import UsageError
from kvoffload.inspection.disk_slabs import (
    SLAB_PREFIX,
    NotASlab,
    SlabFile,
    open_slab,
    parse_slab_name,
)
from kvoffload.inspection.model import (
    BadShare,
    BadSlab,
    DiskNamespaceReport,
    FirstNames,
    Report,
    is_digest_hex,
)
from kvoffload.inspection.slot_scan import SlotScan
from kvoffload.tiers.disk_files import FORMAT_DIR
from kvoffload.tiers.disk_lock import LOCK_NAME, USERS_NAME
from kvoffload.tiers.disk_record import RECORD_FILE, read_disk_record

__all__ = ["SLAB_PREFIX", "inspect_disk", "parse_slab_name", "resolve_root"]


def inspect_disk(path: Path, namespace: str | None, verify: bool, world_size: int | None) -> Report:
    """What the disk tier directory at ``path`` holds: every namespace, or only
    ``namespace`` (32 hex digits). ``path`` may be the tier's root (the directory
    holding ``kvoffload-v1/``), ``kvoffload-v1/`` itself or one namespace directory.
    With ``verify`` every used slot is read in full and checked (:func:`check_slot`).

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
    warnings: list[str] = []
    namespaces = [
        _scan_namespace(
            root, digest, verify=verify, world_size=world_size, stray=stray, warnings=warnings
        )
        for digest in digests
    ]
    return Report(
        tier="disk",
        location=str(root),
        verified=verify,
        namespaces=list(namespaces),
        stray=stray.count,
        stray_examples=[name for name, _ in stray.first()],
        warnings=warnings,
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


def _scan_namespace(
    root: Path,
    digest_hex: str,
    *,
    verify: bool,
    world_size: int | None,
    stray: FirstNames,
    warnings: list[str],
) -> DiskNamespaceReport:
    digest = bytes.fromhex(digest_hex)
    rel = f"{FORMAT_DIR}/{digest_hex}"
    slabs: dict[int, SlabFile] = {}
    bad_slabs: list[BadSlab] = []
    ranks: set[int] = set()
    vanished = 0
    recorded = False
    try:
        for entry in sorted(os.scandir(root / rel), key=lambda e: e.name):
            if entry.name in (LOCK_NAME, USERS_NAME):
                continue  # the engines' locks: not part of the tier's content
            name = f"{rel}/{entry.name}"
            if entry.name == RECORD_FILE and entry.is_file(follow_symlinks=False):
                recorded = True  # the namespace's record, read below
                continue
            rank = parse_slab_name(entry.name)
            if rank is None or not entry.is_file(follow_symlinks=False):
                stray.add(name)
                continue
            ranks.add(rank)
            try:
                slabs[rank] = open_slab(entry.path, name, digest, rank)
            except FileNotFoundError:
                vanished += 1
            except NotASlab as bad:
                bad_slabs.append(BadSlab(name, rank, bad.reason, bad.detail))
        for slab in slabs.values():
            short = slab.short()
            if short is not None:
                bad_slabs.append(short)
        geometries = {(s.block.payload_bytes, s.block.num_slots) for s in slabs.values()}
        if len(geometries) > 1:
            each = ", ".join(
                f"r{r}: {s.block.num_slots} slots of {s.block.payload_bytes} bytes"
                for r, s in sorted(slabs.items())
            )
            warnings.append(
                f"namespace {digest_hex}: the slab files disagree on their geometry ({each}); "
                "the engine adopts no chunk from a slab whose payload size is not its own"
            )
        world = world_size or max(ranks, default=-1) + 1
        scan = SlotScan(digest, slabs, world, verify)
        scan.run()
    finally:
        for slab in slabs.values():
            with contextlib.suppress(OSError):
                os.close(slab.fd)
    bad_slabs.sort(key=lambda bad: bad.rank)
    return DiskNamespaceReport(
        namespace=digest_hex,
        world_size=world,
        complete_chunks=len(scan.complete_keys),
        incomplete_chunks=len(scan.incomplete_keys - scan.complete_keys),
        chunks_per_group=scan.groups.per_group(scan.complete_keys),
        shares_per_rank=dict(sorted(scan.used.items())),
        bytes=sum(n * slabs[rank].stride for rank, n in scan.used.items()),
        format_versions=dict(sorted(scan.versions.items())),
        payload_bytes=dict(sorted(Counter(s.block.payload_bytes for s in slabs.values()).items())),
        vanished=vanished,
        verified=verify,
        ok=scan.ok,
        bad=dict(sorted(scan.bad.items())),
        bad_examples=[
            BadShare(name, *note.split("\0", 1)) for name, note in scan.bad_names.first()
        ],
        slots_per_rank={rank: slabs[rank].block.num_slots for rank in sorted(slabs)},
        capacity_bytes=sum(s.block.num_slots * s.stride for s in slabs.values()),
        duplicate_slots=scan.complete_slots - len(scan.complete_keys),
        bad_slabs=bad_slabs,
        record=read_disk_record(root / rel, digest_hex) if recorded else None,
    )
