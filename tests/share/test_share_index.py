"""The share's index against a set: inserts and removals (with clustered keys, so
removals shift rows back), read by another mapping of the same file."""

from __future__ import annotations

import random
from pathlib import Path

from kvoffload.core.keys import ChunkKey
from kvoffload.share.index import IndexReader, IndexWriter, capacity_for
from kvoffload.share.paths import SharePaths


def share(tmp_path: Path) -> SharePaths:
    paths = SharePaths("index", tmp_path)
    paths.ensure_dir()
    return paths


def clustered(i: int) -> ChunkKey:
    """Keys whose home rows collide: the low bits of bytes 8-16 are few."""
    return ChunkKey(i.to_bytes(8, "little") + (i % 5).to_bytes(8, "little"))


def test_the_index_holds_exactly_the_readable_set(tmp_path: Path) -> None:
    paths = share(tmp_path)
    writer = IndexWriter(paths, num_slots=64, generation=3)
    reader = IndexReader(paths)
    assert reader.generation == 3 and capacity_for(64) == 1024 and capacity_for(200) == 2048
    rng = random.Random(7)
    readable: set[ChunkKey] = set()
    universe = [clustered(i) for i in range(200)]
    for _ in range(600):
        key = rng.choice(universe)
        if key in readable:
            writer.remove([key])
            readable.discard(key)
        elif len(readable) < 64:
            writer.insert([key])
            readable.add(key)
        probe = rng.sample(universe, 4)
        assert [reader.readable_prefix([k]) for k in probe] == [int(k in readable) for k in probe]
    ordered = sorted(readable)
    assert reader.readable_prefix(ordered) == len(ordered)
    assert reader.readable_prefix([*ordered[:3], clustered(999), *ordered[3:]]) == 3
    assert reader.readable_prefix([]) == 0


def test_a_new_generation_starts_empty(tmp_path: Path) -> None:
    paths = share(tmp_path)
    IndexWriter(paths, num_slots=8, generation=1).insert([clustered(1)])
    reader = IndexReader(paths)
    assert reader.readable_prefix([clustered(1)]) == 1
    IndexWriter(paths, num_slots=8, generation=2)  # the same file, cleared
    assert reader.generation == 2 and reader.readable_prefix([clustered(1)]) == 0
