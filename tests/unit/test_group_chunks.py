"""Chunks across KV cache groups: the hit every group can continue from, what a load
fills and a store reads, what a promotion must bring up."""

from __future__ import annotations

from kvoffload.core.directory import Directory
from kvoffload.core.jobs import NO_BLOCK
from kvoffload.core.keys import ChunkKey
from kvoffload.core.kv_groups import KVGroup, KVGroups
from kvoffload.core.scheduler.block_tables import BlockTables
from kvoffload.core.scheduler.group_chunks import (
    load_entries,
    readable_chunks,
    store_entries,
    wanted_entries,
)
from kvoffload.core.scheduler_types import SchedulerConfig

# Block 4 tokens, one block per chunk; group 0 a window of 8 tokens, group 1 full.
GROUPS = KVGroups((KVGroup(window=8), KVGroup()))
CONFIG = SchedulerConfig(block_size=4, kv_groups=GROUPS, null_block=0)
KEYS = [ChunkKey(bytes([i]) * 16) for i in range(10)]


def directory_with(entries: set[tuple[int, int]]) -> Directory:
    """A host directory holding chunk ``c`` of group ``g`` for each (c, g)."""
    d = Directory(64)
    keys = [GROUPS.key(KEYS[c], g) for c, g in sorted(entries)]
    prepared = d.prepare_store(keys, admit_all=True)
    d.complete_store(prepared.keys, True)
    return d


def test_full_groups_bound_the_hit_and_windows_need_only_their_window() -> None:
    full = {(c, 1) for c in range(10)}
    # The window group holds only chunks 7 and 8: a hit of 9 chunks (36 tokens)
    # reads tokens 29..35, chunks 7 and 8.
    d = directory_with(full | {(7, 0), (8, 0)})
    assert readable_chunks(d, GROUPS, KEYS, 0, 4) == 9
    assert readable_chunks(d, GROUPS, KEYS[:7], 0, 4) == 0  # no window chunk at 5, 6


def test_the_hit_shrinks_to_a_fixed_point() -> None:
    two_windows = KVGroups((KVGroup(window=8), KVGroup(window=5), KVGroup()))
    present = {(c, 2) for c in range(10)}
    present |= {(c, 0) for c in (1, 2, 7, 8)} | {(c, 1) for c in (2, 3, 9)}
    d = Directory(64)
    keys = [two_windows.key(KEYS[c], g) for c, g in sorted(present)]
    d.complete_store(d.prepare_store(keys, admit_all=True).keys, True)
    # Group 0 (two chunks) first agrees at 9 (7, 8); group 1 (one chunk) only at 4
    # (3); group 0 again at 3 (1, 2), where group 1 (2) agrees too.
    assert readable_chunks(d, two_windows, KEYS, 0, 4) == 3


def test_chunks_the_engine_computed_need_not_be_readable() -> None:
    d = directory_with({(c, 1) for c in range(10)} | {(8, 0)})
    assert readable_chunks(d, GROUPS, KEYS, 8, 4) == 9  # chunk 7 is the engine's own


def test_a_load_skips_blocks_below_the_window_and_the_engines_own() -> None:
    tables = BlockTables(2)
    tables.replace(([0, 0, 0, 0, 0, 0, 0, 21, 22], [11, 12, 13, 14, 15, 16, 17, 18, 19]))
    entries = load_entries(tables, KEYS, 8, 36, CONFIG)  # load tokens 8..35
    got = [(e.chunk, e.group, e.blocks) for e in entries]
    expected = [(c, 1, (11 + c,)) for c in range(2, 7)]
    expected += [(7, 0, (21,)), (7, 1, (18,)), (8, 0, (22,)), (8, 1, (19,))]
    assert got == expected
    assert all(e.key == GROUPS.key(KEYS[e.chunk], e.group) for e in entries)


def test_a_load_marks_a_partial_first_chunk_no_block() -> None:
    config = SchedulerConfig(block_size=4, blocks_per_chunk=2, kv_groups=GROUPS, null_block=0)
    tables = BlockTables(2)
    tables.replace(([0, 0, 0, 31, 32, 33], [1, 2, 3, 4, 5, 6]))
    entries = load_entries(tables, KEYS, 4, 24, config)  # chunks of 8 tokens: 0, 1, 2
    assert [(e.chunk, e.group, e.blocks) for e in entries] == [
        (0, 1, (NO_BLOCK, 2)),  # tokens 0..3 are the engine's own
        (1, 1, (3, 4)),  # the window reads tokens 17..23 (blocks 4, 5): chunk 2 only
        (2, 0, (32, 33)),
        (2, 1, (5, 6)),
    ]


def test_a_store_skips_window_chunks_the_engine_may_have_freed() -> None:
    tables = BlockTables(2)
    tables.replace(([5, 6, 7, 0], [1, 2, 3, 4]))
    source = store_entries(tables, KEYS, 0, 4, scheduled_from=14, config=CONFIG)
    # 14 tokens computed: the window keeps tokens from 7 (block 1) on; block 3 is null.
    entries = list(zip(source.chunks, source.groups, strict=True))
    assert entries == [(0, 1), (1, 0), (1, 1), (2, 0), (2, 1), (3, 1)]
    assert source.before(2).chunks == [0, 1, 1]


def test_a_promotion_wants_only_what_host_memory_lacks_for_the_hit() -> None:
    d = directory_with({(c, 1) for c in range(4)})
    wanted = wanted_entries(d, GROUPS, KEYS, readable=0, hit=6, chunk=4)
    # Full group: chunks 4 and 5; the window group: what tokens 17..23 read, 4 and 5.
    assert [(e.chunk, e.group) for e in wanted] == [(4, 0), (4, 1), (5, 0), (5, 1)]
