"""A request's engine blocks: one block table per KV cache group.

Block ``i`` of group ``g``'s table holds that group's KV of tokens
``[i * block_size, (i + 1) * block_size)``. Tables mirror what the engine told the
scheduler half (an allocation, or the blocks a step added); a window group's table
may hold the engine's null block (skipped tokens) and, once the engine freed blocks
below its window mid-request, ids that are no longer the request's: which blocks
are still live is the caller's rule (:meth:`KVGroups.first_live_block`), never read
from here. Owned by one :class:`RequestState`; written by the allocations and the
step builder only.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

GroupBlocks = Sequence[Sequence[int]]
"""Blocks per KV cache group, in the engine's group order."""


class BlockTables:
    __slots__ = ("tables",)

    def __init__(self, groups: int) -> None:
        self.tables: list[list[int]] = [[] for _ in range(groups)]

    def __getitem__(self, group: int) -> list[int]:
        return self.tables[group]

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.tables)

    def replace(self, blocks: GroupBlocks) -> None:
        """The request's whole allocation (a group the engine left out is empty)."""
        for g, table in enumerate(self.tables):
            table[:] = blocks[g] if g < len(blocks) else ()

    def extend(self, blocks: GroupBlocks) -> None:
        """Blocks the engine appended this step, per group."""
        for table, more in zip(self.tables, blocks, strict=False):
            table.extend(more)

    def clear(self) -> None:
        for table in self.tables:
            table.clear()

    def num_blocks(self) -> int:
        """Blocks every group's table has (the tables grow together)."""
        tables = self.tables
        return len(tables[0]) if len(tables) == 1 else min(len(t) for t in tables)

    def all_blocks(self) -> set[int]:
        tables = self.tables
        return set(tables[0]) if len(tables) == 1 else {b for t in tables for b in t}


def flat(blocks: GroupBlocks) -> list[int]:
    """Every block of ``blocks``, group after group."""
    return [b for table in blocks for b in table]
