"""Rebuild the disk tier's directory from the files on disk (scheduler side, start-up).

Temporary files of interrupted writes are removed. A chunk counts only if every
rank's file is there; the files of incomplete chunks are removed. Chunks are
entered oldest first (by the newest of their files' modification times), so the
most recently written are the last evicted; beyond the tier's capacity the oldest
chunks' files are removed. Contents are verified when read, not here.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from kvoffload.core.directory import Directory
from kvoffload.core.keys import ChunkKey
from kvoffload.core.policies import EvictionPolicy
from kvoffload.core.tiering import DirectoryTier
from kvoffload.tiers.disk import ChunkFile, scan, sweep, unlink_quietly


def open_disk_tier(
    root: Path,
    namespace_digest: bytes,
    world_size: int,
    num_slots: int,
    policy: str | EvictionPolicy = "lru",
) -> tuple[DirectoryTier, int]:
    """The disk tier with every complete chunk found; and how many files were removed."""
    removed = sweep(root, namespace_digest)
    files: dict[ChunkKey, list[ChunkFile]] = defaultdict(list)
    for chunk_file in scan(root, namespace_digest):
        files[chunk_file.key].append(chunk_file)
    complete: list[tuple[float, ChunkKey]] = []
    for key, shares in files.items():
        if sorted(f.rank for f in shares) == list(range(world_size)):
            complete.append((max(f.mtime for f in shares), key))
        else:
            removed += _remove(shares)
    complete.sort()
    extra = len(complete) - num_slots
    if extra > 0:
        for _, key in complete[:extra]:
            removed += _remove(files[key])
        complete = complete[extra:]
    directory = Directory(num_slots, tier="disk", policy=policy)
    keys = [key for _, key in complete]
    for start in range(0, len(keys), 4096):
        prepared = directory.prepare_store(keys[start : start + 4096], admit_all=True)
        directory.complete_store(prepared.keys, success=True)
    return DirectoryTier(directory), removed


def _remove(found: list[ChunkFile]) -> int:
    for f in found:
        unlink_quietly(f.path)
    return len(found)
