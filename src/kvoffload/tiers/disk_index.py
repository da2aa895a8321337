"""Rebuild the disk tier's directory from the slabs on disk (scheduler side, start-up).

Every rank's slab is scanned slot by slot (headers only; payloads are verified when
read). A slot is adopted when every rank's header in it is a valid header of this
namespace naming the same chunk, of any KV cache group the header validly names (the
group is checked when a promotion reads the chunk back for the group it wants); a
chunk found in several slots (an older copy not yet overwritten) keeps its newest
copy. Chunks are entered oldest first (by write sequence number), so the most
recently written are the last evicted. Nothing is modified: slots not adopted are
free and will be written over.

Cost: one small read per slot and rank (about a second per million slots).

:func:`recover_chunks` is the scan and the choice of copies; :func:`open_disk_tier`
(a private engine's scheduler half) and a disk share's node process
(:mod:`kvoffload.tiers.disk_backing`) both restore its entries into their directory.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

from kvoffload.core.chunk_format import HEADER_BYTES, IntegrityError, check_header
from kvoffload.core.config.own_options import default
from kvoffload.core.directory import Directory
from kvoffload.core.keys import ChunkKey, shard_key
from kvoffload.core.policies import EvictionPolicy
from kvoffload.core.private_files import open_checked
from kvoffload.core.tiering.lower import DirectoryTier
from kvoffload.tiers.disk import KEY_OFFSET, parse_header_block, slab_path, slot_bytes
from kvoffload.tiers.disk_files import disk_policy
from kvoffload.tiers.slab_format import SUPERBLOCK_BYTES, Superblock, SuperblockError

_HEAD = KEY_OFFSET + 24  # header, chunk key, sequence number
_EVICTION: str = default("eviction")  # the disk directory's policy unless given


@dataclass(frozen=True)
class Recovery:
    adopted: int  # chunks entered into the directory
    ignored: int  # per-rank slot copies not adopted (damaged, incomplete, older duplicates)


def scan_slab(
    path: Path, namespace_digest: bytes, rank: int, payload_bytes: int, num_slots: int
) -> tuple[dict[int, tuple[ChunkKey, int]], int]:
    """Valid headers of one rank's slab: slot -> (chunk key, sequence number); and
    how many non-empty slots were not valid. A missing slab, or one of another
    geometry, has none."""
    found: dict[int, tuple[ChunkKey, int]] = {}
    invalid = 0
    try:  # never a link, never a file of another user's (decision 0018): ConfigError
        fd = open_checked(path, os.O_RDONLY, disk_policy(path.parent))
    except FileNotFoundError:
        return found, 0
    try:
        try:
            block = Superblock.decode(os.pread(fd, SUPERBLOCK_BYTES, 0))
        except SuperblockError:
            return found, 0
        if (block.namespace_digest, block.rank, block.payload_bytes) != (
            namespace_digest, rank, payload_bytes,
        ):  # fmt: skip
            return found, 0
        stride = slot_bytes(payload_bytes)
        for slot in range(min(block.num_slots, num_slots)):
            head = os.pread(fd, _HEAD, SUPERBLOCK_BYTES + slot * stride)
            if len(head) < _HEAD or not any(head[:4]):
                continue  # never written (or cleared)
            key, seq = parse_header_block(head)
            try:
                storage_key = shard_key(key, rank)
                check_header(
                    head[:HEADER_BYTES], namespace_digest, storage_key, payload_bytes, group=None
                )
            except IntegrityError:
                invalid += 1
                continue
            found[slot] = (key, seq)
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    return found, invalid


def recover_chunks(
    root: Path, namespace_digest: bytes, world_size: int, num_slots: int, payload_bytes: int
) -> tuple[list[tuple[ChunkKey, int]], Recovery]:
    """The complete chunks in the slabs under ``root``, as ``(key, slot)`` entries
    oldest first (what :meth:`Directory.restore` takes), and the counts. Reads only."""
    ranks = []
    ignored = 0
    for rank in range(world_size):
        path = slab_path(root, namespace_digest, rank)
        found, invalid = scan_slab(path, namespace_digest, rank, payload_bytes, num_slots)
        ranks.append(found)
        ignored += invalid
    newest: dict[ChunkKey, tuple[int, int]] = {}  # key -> (sequence, slot)
    for slot, (key, seq) in ranks[0].items():
        complete = all(other.get(slot, (None, 0))[0] == key for other in ranks[1:])
        if complete and (key not in newest or newest[key][0] < seq):
            newest[key] = (seq, slot)
    ignored += sum(len(found) for found in ranks) - len(newest) * world_size
    entries = sorted((seq, key, slot) for key, (seq, slot) in newest.items())
    return [(key, slot) for _, key, slot in entries], Recovery(len(entries), ignored)


def open_disk_tier(
    root: Path,
    namespace_digest: bytes,
    world_size: int,
    num_slots: int,
    payload_bytes: int,
    *,
    policy: str | EvictionPolicy = _EVICTION,
) -> tuple[DirectoryTier, Recovery]:
    """The disk tier with every complete chunk found in the slabs under ``root``."""
    entries, recovery = recover_chunks(root, namespace_digest, world_size, num_slots, payload_bytes)
    directory = Directory(num_slots, tier="disk", policy=policy)
    directory.restore(entries)
    return DirectoryTier(directory), recovery
