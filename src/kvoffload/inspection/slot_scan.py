"""The slot-by-slot scan of one namespace's slab files (see
:mod:`kvoffload.inspection.disk_scan` for what is counted and why).

:class:`SlotScan` reads each slot's header block on every rank, tallies used slots,
format versions, complete or incomplete chunks and the KV cache group each valid
header names, and with ``verify`` reads whole slots and records bad ones. It reads
only; the slabs' descriptors stay the caller's.
"""

from __future__ import annotations

import os
from collections import Counter

from kvoffload.core.keys import ChunkKey
from kvoffload.inspection.checks import (
    SLOT_HEAD_BYTES,
    check_slot,
    check_slot_header,
    header_fields,
    slot_key,
)
from kvoffload.inspection.disk_slabs import SlabFile
from kvoffload.inspection.groups import GroupTally
from kvoffload.inspection.model import UNKNOWN_VERSION, FirstNames
from kvoffload.tiers.disk import PAYLOAD_OFFSET
from kvoffload.tiers.slab_format import SUPERBLOCK_BYTES

_EMPTY_HEAD = bytes(SLOT_HEAD_BYTES)


class SlotScan:
    """Walks the slots of one namespace's good slabs, slot by slot across ranks."""

    def __init__(self, digest: bytes, slabs: dict[int, SlabFile], world: int, verify: bool) -> None:
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
        self.groups = GroupTally()  # the group of each chunk a valid header names

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

    def _used(self, slab: SlabFile, slot: int, offset: int, head: bytes) -> ChunkKey | None:
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
        if error is not None:
            return None
        key = slot_key(head)
        self.groups.note(key, head)
        return key

    def _unreadable(self, slab: SlabFile, slot: int, exc: OSError) -> None:
        """A slot whose header block could not be read: used, of unknown version."""
        self.used[slab.rank] += 1
        self.versions[UNKNOWN_VERSION] += 1
        self._verdict(slab, slot, ("unreadable", f"unreadable: {exc.strerror or exc}"))

    def _check_whole(self, slab: SlabFile, offset: int) -> tuple[str, str] | None:
        size = min(PAYLOAD_OFFSET + slab.block.payload_bytes, max(0, slab.size - offset))
        try:
            data = os.pread(slab.fd, size, offset)
        except OSError as exc:
            return ("unreadable", f"unreadable: {exc.strerror or exc}")
        error = check_slot(data, self.digest, slab.rank, slab.block.payload_bytes)
        return None if error is None else (error.reason.value, str(error))

    def _verdict(self, slab: SlabFile, slot: int, failure: tuple[str, str] | None) -> None:
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
