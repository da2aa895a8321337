"""A request's chunks across KV cache groups: what a hit needs, what a load fills,
what a store reads (the rules are in :mod:`kvoffload.core.kv_groups`).

With one full-attention group every function here reduces to the plain chunk
chain: chunk ``c`` is the chain key ``keys[c]`` and blocks ``[c * k, (c + 1) * k)``.
With several groups an *entry* is one group's chunk. Pure over what they are given:
they read the directory and the request's block tables and mutate nothing.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvoffload.core.directory import HostDirectory
from kvoffload.core.jobs import NO_BLOCK
from kvoffload.core.keys import ChunkKey
from kvoffload.core.kv_groups import KVGroups
from kvoffload.core.scheduler.block_tables import BlockTables
from kvoffload.core.scheduler_types import SchedulerConfig


class Entry(NamedTuple):
    """Group ``group``'s chunk ``chunk``: its key and its engine blocks (a load's
    blocks the engine computes itself or never reads are :data:`NO_BLOCK`). A named
    tuple: one is built per chunk a store reads, every step."""

    chunk: int
    group: int
    key: ChunkKey
    blocks: tuple[int, ...]


def readable_chunks(
    directory: HostDirectory,
    groups: KVGroups,
    keys: Sequence[ChunkKey],
    local_chunks: int,
    chunk: int,
) -> int:
    """The longest hit, in chunks of ``keys``, every group can serve from ``directory``
    on top of the engine's own ``local_chunks`` (whole chunks it computed: they need
    not be in ``directory``): the readable run after them common to the full-attention
    groups, shrunk until each window group's chunks after ``local_chunks`` that its
    window reads are readable too (repeated to a fixed point: every shrink can only
    shrink it further)."""
    local_chunks = min(local_chunks, len(keys))
    if groups.plain:
        return local_chunks + directory.readable_prefix(keys[local_chunks:])
    hit = len(keys)
    for g, group in enumerate(groups.groups):
        if group.full:
            tail = [groups.key(k, g) for k in keys[local_chunks:hit]]
            hit = min(hit, local_chunks + directory.readable_prefix(tail))
    windows = [g for g, group in enumerate(groups.groups) if not group.full]
    while True:
        before = hit
        for g in windows:
            hit = _window_hit(
                directory,
                groups,
                group=g,
                keys=keys,
                hit=hit,
                local_chunks=local_chunks,
                chunk=chunk,
            )
        if hit == before:
            return hit


def _window_hit(
    directory: HostDirectory,
    groups: KVGroups,
    *,
    group: int,
    keys: Sequence[ChunkKey],
    hit: int,
    local_chunks: int,
    chunk: int,
) -> int:
    """The largest ``h <= hit`` whose window chunks of ``group`` are readable."""
    readable: dict[int, bool] = {}

    def ok(c: int) -> bool:
        if c not in readable:
            readable[c] = directory.readable_prefix([groups.key(keys[c], group)]) == 1
        return readable[c]

    for h in range(hit, local_chunks, -1):
        first = max(local_chunks, groups.first_needed_chunk(group, h * chunk, chunk))
        if all(ok(c) for c in range(first, h)):
            return h
    return min(hit, local_chunks)


def load_entries(
    tables: BlockTables, keys: Sequence[ChunkKey], local: int, hit: int, config: SchedulerConfig
) -> list[Entry]:
    """The entries a load of tokens ``[local, hit)`` fills: per chunk, every group
    that reads it after ``hit`` tokens. Blocks before ``local`` (the engine computed
    them) and below a window (the engine's null block) are :data:`NO_BLOCK`."""
    groups, chunk, k = config.kv_groups, config.chunk_tokens, config.blocks_per_chunk
    local_block = local // config.block_size
    out = []
    for c in range(local // chunk, hit // chunk):
        for g in range(len(groups)):
            if c < groups.first_needed_chunk(g, hit, chunk):
                continue
            live = max(local_block, groups.first_live_block(g, hit, config.block_size))
            table = tables[g]
            blocks = tuple(table[i] if i >= live else NO_BLOCK for i in range(c * k, (c + 1) * k))
            out.append(Entry(c, g, groups.key(keys[c], g), blocks))
    return out


@dataclass(frozen=True, slots=True)
class StoreSource:
    """What a store of chunks reads: entry ``i`` is chunk ``chunks[i]`` of group
    ``groups[i]``, under ``keys[i]``, from the engine blocks ``blocks[i]``; chunks
    ascend. Parallel lists rather than :class:`Entry` values: one is built for every
    running request, every step."""

    chunks: list[int]
    groups: list[int]
    keys: list[ChunkKey]
    blocks: list[Sequence[int]]

    def __len__(self) -> int:
        return len(self.keys)

    def before(self, end: int) -> StoreSource:
        """The entries of the chunks below ``end``."""
        i = bisect_left(self.chunks, end)
        return StoreSource(self.chunks[:i], self.groups[:i], self.keys[:i], self.blocks[:i])


def store_entries(
    tables: BlockTables,
    keys: Sequence[ChunkKey],
    start: int,
    end: int,
    *,
    scheduled_from: int,
    config: SchedulerConfig,
) -> StoreSource:
    """The entries of chunks ``[start, end)`` a store can read now: every group's,
    except a window group's chunk whose blocks the engine may have freed (below its
    window once it counted ``scheduled_from`` tokens computed) or never held (its
    null block). Those are not stored: a later hit that needs them is shrunk."""
    groups, k = config.kv_groups, config.blocks_per_chunk
    if groups.plain:
        table = tables[0]
        chunks = list(range(start, end))
        blocks: list[Sequence[int]] = [table[c * k : (c + 1) * k] for c in chunks]
        return StoreSource(chunks, [0] * len(chunks), list(keys[start:end]), blocks)
    out = StoreSource([], [], [], [])
    for c in range(start, end):
        for g, group in enumerate(groups.groups):
            chunk_blocks = tables[g][c * k : (c + 1) * k]
            if not group.full:
                live = groups.first_live_block(g, scheduled_from, config.block_size)
                if c * k < live or config.null_block in chunk_blocks:
                    continue
            out.chunks.append(c)
            out.groups.append(g)
            out.keys.append(groups.key(keys[c], g))
            out.blocks.append(chunk_blocks)
    return out


def wanted_entries(
    directory: HostDirectory,
    groups: KVGroups,
    keys: Sequence[ChunkKey],
    *,
    readable: int,
    hit: int,
    chunk: int,
) -> list[Entry]:
    """The entries of chunks ``[readable, hit)`` a hit of ``hit`` chunks needs that
    ``directory`` cannot serve yet (what a promotion would bring up), in chunk order."""
    out = []
    for c in range(readable, hit):
        for g in range(len(groups)):
            if c < groups.first_needed_chunk(g, hit * chunk, chunk):
                continue
            key = groups.key(keys[c], g)
            if directory.readable_prefix([key]) == 0:
                out.append(Entry(c, g, key, ()))
    return out
