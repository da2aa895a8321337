"""The reference engine's block tables for several KV cache groups (GroupTables): a
window group frees its blocks below the window into the shared pool and keeps the
null block in their place; the prefix-cache hit is what every group can serve."""

from __future__ import annotations

import pytest

from kvoffload.core.kv_groups import KVGroup, KVGroups
from kvoffload.core.scheduler_types import ScheduledRequest
from kvoffload.engine.batcher import Batcher
from kvoffload.engine.block_pool import BlockPool
from kvoffload.engine.group_tables import NULL_BLOCK, GroupTables
from kvoffload.engine.request import Request
from kvoffload.engine.settings import EngineConfig
from kvoffload.simulate.groups import request_blocks, request_capacity

BS = 4
GROUPS = KVGroups((KVGroup(), KVGroup(window=8)))  # full, window of 8 tokens


def engine(blocks: int = 64, budget: int = 4) -> tuple[Batcher, GroupTables]:
    pool = BlockPool(blocks, BS)
    tables = GroupTables(pool, GROUPS)
    config = EngineConfig(num_blocks=blocks, block_size=BS, token_budget=budget)
    return Batcher(config, pool, None, registration=tables, tables=tables), tables


def run_step(batcher: Batcher) -> list[ScheduledRequest]:
    scheduled, _ = batcher.schedule()
    for _, req in scheduled:
        batcher.cache_computed(req)
    return [s for s, _ in scheduled]


def test_a_window_group_frees_its_blocks_below_the_window_and_nulls_them() -> None:
    batcher, tables = engine()
    pool = batcher.pool
    req = Request("a", list(range(20)), 4, BS)
    batcher.waiting.append(req)
    assert pool.num_free == 63  # the null block is taken
    seen = []
    for _ in range(5):  # 4 tokens (one block) per step: 20 tokens
        (sched,) = run_step(batcher)
        assert req.groups is not None
        seen.append((sched.num_computed_tokens, [list(t) for t in req.groups.tables]))
        full, window = tables.held_blocks(req)
        assert full == len(req.groups.tables[0]) == -(-req.num_computed_tokens // BS)
        assert window <= request_blocks(KVGroups((KVGroup(window=8),)), 20, BS, 4)
        assert pool.num_free == 63 - full - window
    # Scheduled from 12 computed tokens the window (8) skips tokens 0..4: block 0 is
    # freed; from 16, tokens 0..8: blocks 0 and 1.
    start, (full_table, window_table) = seen[3]
    assert start == 12 and window_table[0] == NULL_BLOCK and NULL_BLOCK not in window_table[1:]
    start, (full_table, window_table) = seen[4]
    assert start == 16 and window_table[:2] == [NULL_BLOCK, NULL_BLOCK]
    assert NULL_BLOCK not in full_table and len(full_table) == len(window_table) == 5
    # Freed blocks are back in the pool; finishing frees the rest.
    batcher.running.remove(req)
    batcher.free_blocks(req)
    assert pool.num_free == 63 and req.groups is None and req.block_ids == []


def test_each_step_tells_the_scheduler_half_every_groups_new_blocks() -> None:
    batcher, _ = engine()
    req = Request("a", list(range(12)), 4, BS)
    batcher.waiting.append(req)
    first = run_step(batcher)[0]
    assert first.replace and len(first.block_ids) == 2
    assert all(len(blocks) == 1 for blocks in first.block_ids)
    second = run_step(batcher)[0]
    assert not second.replace
    full_new, window_new = second.block_ids
    assert len(full_new) == len(window_new) == 1 and set(full_new).isdisjoint(window_new)
    assert req.groups is not None
    assert list(req.groups.tables[1]) == [first.block_ids[1][0], window_new[0]]


def finish(batcher: Batcher, req: Request) -> None:
    batcher.running.remove(req)
    batcher.free_blocks(req)


def test_the_prefix_cache_hit_is_what_every_group_can_serve() -> None:
    batcher, tables = engine(budget=64)
    pool = batcher.pool
    first = Request("a", list(range(20)), 1, BS)
    batcher.waiting.append(first)
    run_step(batcher)  # computes all 20 tokens in one step: every block registered
    assert first.groups is not None
    window_blocks = list(first.groups.tables[1])
    finish(batcher, first)
    again = Request("b", [*range(20), 99], 1, BS)  # hit capped below the last token
    hit = tables.cached(again)
    assert hit.tokens == 20  # 5 blocks
    full, window = hit.blocks
    assert len(full) == 5 and NULL_BLOCK not in full
    # From 20 tokens the window (8) reads tokens 13..: blocks 3 and 4 only.
    assert window == [NULL_BLOCK] * 3 + window_blocks[3:5]
    # Without the window group's block 4 the hit shrinks to 16 tokens, which needs
    # window blocks 2 and 3 (block 2 keeps its hash while free).
    evicted = window_blocks[4]
    del pool.cached[pool.hash_of[evicted] or b""]
    pool.hash_of[evicted] = None
    hit = tables.cached(again)
    assert hit.tokens == 16
    assert hit.blocks[1] == [NULL_BLOCK] * 2 + window_blocks[2:4]
    # Admitting it acquires exactly those blocks; the window's are not the full group's.
    batcher.waiting.append(again)
    (sched,) = run_step(batcher)
    assert sched.num_computed_tokens == 16 and sched.replace
    assert sched.block_ids[1][:4] == (NULL_BLOCK, NULL_BLOCK, *window_blocks[2:4])


def test_a_window_only_model_holds_any_length_a_full_group_bounds_it() -> None:
    full_window = KVGroups((KVGroup(), KVGroup(window=1024)))
    # 4096 blocks of 64 tokens, 8192 tokens computed per step: a request of T tokens
    # holds ceil(T / 64) full blocks and at most (1023 + 8192) // 64 + 2 = 145 window
    # blocks, so the longest is 64 * (4096 - 145) tokens.
    assert request_blocks(full_window, 100_000, 64, 8192) == 1563 + 145
    assert request_capacity(full_window, 4096, 64, 8192) == 64 * (4096 - 145)
    assert request_capacity(KVGroups((KVGroup(window=1024),)), 4096, 64, 8192) is None
    assert request_capacity(KVGroups(), 4096, 64, 8192) == 4096 * 64


def test_group_tables_need_an_unused_pool() -> None:
    pool = BlockPool(8, BS)
    pool.allocate(1)
    with pytest.raises(ValueError, match="none used"):
        GroupTables(pool, GROUPS)
