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
(:func:`~kvoffload.inspection.model.check_slot`); that changes none of the counts.

Cost: one ``pread`` of a slot's first 88 bytes per slot and slab, slot by slot, with
readahead off for the file so payloads are not read; with ``verify`` a second
``pread`` of the header block and payload of each used slot. Memory: one key per
complete chunk.

A slab file whose superblock is unreadable, or names another namespace or rank, is
reported as a bad slab and not scanned. One shorter than its superblock says is
reported as bad (``short``) and scanned as far as it goes: slots past the end read
as empty, as recovery reads them. Anything under ``kvoffload-v1/`` that is not a
namespace directory or a slab file (a regular file named exactly ``slab.r<rank>``,
rank in ASCII digits without leading zeros) counts as *stray*, the fan-out
directories of the former one-file-per-chunk layout included: the engine never reads
them. Entries are visited in name order and slots in order, so reports are
deterministic.

Files are opened ``O_RDONLY`` (``O_NOFOLLOW``); nothing is created, changed or
deleted. Reading may update access times, which kvoffload does not use.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from kvoffload.core.errors import UsageError
from kvoffload.core.keys import ChunkKey
from kvoffload.inspection.model import (
    MAX_RANK,
    SLOT_HEAD_BYTES,
    UNKNOWN_VERSION,
    BadShare,
    BadSlab,
    DiskNamespaceReport,
    FirstNames,
    Report,
    check_slot,
    check_slot_header,
    header_fields,
    is_digest_hex,
    slot_key,
)
from kvoffload.tiers.disk import FORMAT_DIR, PAYLOAD_OFFSET
from kvoffload.tiers.slab_format import SUPERBLOCK_BYTES, Superblock, SuperblockError

SLAB_PREFIX = "slab.r"
"""A slab file's name is this and its rank (``kvoffload.tiers.disk.slab_path``)."""

_EMPTY_HEAD = bytes(SLOT_HEAD_BYTES)
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)


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


def parse_slab_name(name: str) -> int | None:
    """The rank of a slab file's name (``slab.r<rank>``, exactly as the disk tier
    names it); None for any other name."""
    if not name.startswith(SLAB_PREFIX):
        return None
    rank = name[len(SLAB_PREFIX) :]
    if not (rank.isascii() and rank.isdigit()) or str(int(rank)) != rank:
        return None
    return int(rank) if int(rank) <= MAX_RANK else None


@dataclass
class _Slab:
    """One open slab file whose superblock names its namespace and rank."""

    name: str  # relative to the tier root
    rank: int
    fd: int
    block: Superblock
    size: int  # of the file, in bytes
    stride: int = field(init=False)  # slot bytes
    present: int = field(init=False)  # slots that start before the end of the file

    def __post_init__(self) -> None:
        self.stride = self.block.slot_bytes
        beyond = max(0, self.size - SUPERBLOCK_BYTES)
        self.present = min(self.block.num_slots, -(-beyond // self.stride))

    @property
    def expected_size(self) -> int:
        return SUPERBLOCK_BYTES + self.block.num_slots * self.stride

    def short(self) -> BadSlab | None:
        if self.size >= self.expected_size:
            return None
        whole = max(0, self.size - SUPERBLOCK_BYTES) // self.stride
        last = self.block.num_slots - 1
        cut = f"slot {whole}" if whole == last else f"slots {whole}..{last}"
        detail = f"short: {self.size} of {self.expected_size} bytes, {cut} cut off"
        return BadSlab(self.name, self.rank, "short", detail)


class _NotASlab(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def _open_slab(path: str, name: str, digest: bytes, rank: int) -> _Slab:
    """Open a slab file read-only and read its superblock. :class:`_NotASlab` when it
    is not a slab of this namespace and rank; ``FileNotFoundError`` when it is gone."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise _NotASlab("unreadable", f"unreadable: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _NotASlab("unreadable", "not a regular file")
        try:
            block = Superblock.decode(os.pread(fd, SUPERBLOCK_BYTES, 0))
        except SuperblockError as exc:
            raise _NotASlab("superblock", f"bad superblock: {exc}") from None
        except OSError as exc:
            raise _NotASlab("unreadable", f"unreadable: {exc.strerror or exc}") from None
        if (block.namespace_digest, block.rank) != (digest, rank):
            raise _NotASlab(
                "foreign",
                f"the superblock names namespace {block.namespace_digest.hex()} "
                f"rank {block.rank}, not this file's",
            )
        with contextlib.suppress(AttributeError, OSError):  # payloads are read only on demand
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return _Slab(name, rank, fd, block, st.st_size)
    except BaseException:
        os.close(fd)
        raise


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
    slabs: dict[int, _Slab] = {}
    bad_slabs: list[BadSlab] = []
    ranks: set[int] = set()
    vanished = 0
    try:
        for entry in sorted(os.scandir(root / rel), key=lambda e: e.name):
            name = f"{rel}/{entry.name}"
            rank = parse_slab_name(entry.name)
            if rank is None or not entry.is_file(follow_symlinks=False):
                stray.add(name)
                continue
            ranks.add(rank)
            try:
                slabs[rank] = _open_slab(entry.path, name, digest, rank)
            except FileNotFoundError:
                vanished += 1
            except _NotASlab as bad:
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
        scan = _SlotScan(digest, slabs, world, verify)
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
    )


class _SlotScan:
    """Walks the slots of one namespace's good slabs, slot by slot across ranks."""

    def __init__(self, digest: bytes, slabs: dict[int, _Slab], world: int, verify: bool) -> None:
        self.digest = digest
        self.slabs = [slabs[rank] for rank in sorted(slabs)]
        self.world = world
        self.verify = verify
        required = [slabs.get(rank) for rank in range(world)]
        # as recovery: every rank's slab there, all of one payload size (the engine's)
        self.completable = bool(required) and all(s is not None for s in required)
        self.completable &= len({s.block.payload_bytes for s in required if s}) == 1
        self.used: Counter[int] = Counter({slab.rank: 0 for slab in self.slabs})
        self.versions: Counter[str] = Counter()
        self.bad: Counter[str] = Counter()
        self.bad_names = FirstNames()
        self.ok = 0
        self.complete_keys: set[bytes] = set()
        self.incomplete_keys: set[bytes] = set()  # minus complete_keys at the end
        self.complete_slots = 0

    def run(self) -> None:
        slots = max((slab.present for slab in self.slabs), default=0)
        each = [(slab, slab.fd, slab.stride, slab.present) for slab in self.slabs]
        pread, empty = os.pread, _EMPTY_HEAD
        for slot in range(slots):  # the hot loop: one pread and one compare per empty slot
            named: dict[int, ChunkKey] = {}
            for slab, fd, stride, present in each:
                if slot >= present:
                    continue
                offset = SUPERBLOCK_BYTES + slot * stride
                try:
                    head = pread(fd, SLOT_HEAD_BYTES, offset)
                except OSError as exc:
                    self._unreadable(slab, slot, exc)
                    continue
                if head == empty or head.count(0) == len(head):
                    continue  # never written, or cleared
                key = self._used(slab, slot, offset, head)
                if key is not None:
                    named[slab.rank] = key
            if named:
                self._count(named)

    def _used(self, slab: _Slab, slot: int, offset: int, head: bytes) -> ChunkKey | None:
        """Tally one rank's used slot; the chunk key its header validly names, or None."""
        self.used[slab.rank] += 1
        fields = header_fields(head)
        self.versions[UNKNOWN_VERSION if fields is None else str(fields[0])] += 1
        error = check_slot_header(head, self.digest, slab.rank, slab.block.payload_bytes)
        if self.verify:
            failure = None if error is None else (error.reason.value, str(error))
            if error is None:
                failure = self._check_whole(slab, offset)
            self._verdict(slab, slot, failure)
        return slot_key(head) if error is None else None

    def _unreadable(self, slab: _Slab, slot: int, exc: OSError) -> None:
        """A slot whose header block could not be read: used, of unknown version."""
        self.used[slab.rank] += 1
        self.versions[UNKNOWN_VERSION] += 1
        self._verdict(slab, slot, ("unreadable", f"unreadable: {exc.strerror or exc}"))

    def _check_whole(self, slab: _Slab, offset: int) -> tuple[str, str] | None:
        size = min(PAYLOAD_OFFSET + slab.block.payload_bytes, max(0, slab.size - offset))
        try:
            data = os.pread(slab.fd, size, offset)
        except OSError as exc:
            return ("unreadable", f"unreadable: {exc.strerror or exc}")
        error = check_slot(data, self.digest, slab.rank, slab.block.payload_bytes)
        return None if error is None else (error.reason.value, str(error))

    def _verdict(self, slab: _Slab, slot: int, failure: tuple[str, str] | None) -> None:
        if not self.verify:
            return
        if failure is None:
            self.ok += 1
        else:
            self.bad[failure[0]] += 1
            name = f"{slab.name} slot {slot}"
            self.bad_names.add(name, f"{failure[0]}\0{failure[1]}", order=(slab.rank, slot))

    def _count(self, named: dict[int, ChunkKey]) -> None:
        """One slot's verdict: complete when ranks 0..N-1 all name one chunk."""
        first = named.get(0)
        if (
            self.completable
            and first is not None
            and all(named.get(rank) == first for rank in range(1, self.world))
        ):
            self.complete_slots += 1
            self.complete_keys.add(first)
            self.incomplete_keys.update(key for key in named.values() if key != first)
        else:
            self.incomplete_keys.update(named.values())
