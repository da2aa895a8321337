"""How the reference engine lays a request's KV out in blocks: its block tables.

A :class:`Tables` strategy, owned by one batcher, makes every block decision of
batch formation for one block pool:

- :meth:`Tables.cached`: the engine's prefix-cache hit of a request being admitted
  (what it is, not acquired yet);
- :meth:`Tables.admit`: the tables of an admission (the hit's blocks and fresh ones),
  and :meth:`Tables.resume`: where the request continues once its load landed;
- :meth:`Tables.need` / :meth:`Tables.scheduled`: the fresh blocks a scheduled step
  needs, then placing them and telling the scheduler half (a
  :class:`~kvoffload.core.scheduler_types.ScheduledRequest`);
- :meth:`Tables.tables` / :meth:`Tables.release`: the tables as the scheduler half
  takes them (``on_allocated``), and freeing them.

:class:`OneTable` is the reference: one full-attention KV cache group, whose table is
``req.block_ids``. :class:`~kvoffload.engine.group_tables.GroupTables` lays several
groups (a hybrid model: full attention and sliding windows) out in one pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

from kvoffload.core.scheduler_types import ScheduledRequest
from kvoffload.engine.block_pool import BlockPool
from kvoffload.engine.request import Request


class CachedPrefix(NamedTuple):
    """The engine's prefix-cache hit of one request: ``tokens`` (whole blocks) and,
    per KV cache group, the blocks holding them (a window group's blocks below its
    window are the null block). Nothing is acquired yet. A named tuple: one is built
    per admission."""

    tokens: int
    blocks: tuple[list[int], ...]


class Tables(Protocol):
    """The block decisions of batch formation (see the module docstring). Mutates
    the pool and the requests' tables only."""

    def cached(self, req: Request) -> CachedPrefix:
        """The longest prefix-cache hit every group can serve, below the request's
        last token (that one is always computed)."""

    def admit(self, req: Request, hit: CachedPrefix, tokens: int, computed: int) -> bool:
        """Give ``req`` tables covering its first ``tokens`` positions: ``hit``'s
        blocks (acquired), then fresh ones. ``computed`` (>= ``hit.tokens``): the
        tokens that will hold KV before the first forward pass (the hit and a load);
        a window group holds no block below its window of them. False, changing
        nothing, when the pool has too few free blocks."""

    def resume(self, req: Request, computed: int) -> int:
        """The tokens ``req``, whose load just landed, continues from: ``computed``
        (the hit, plus the load when it succeeded), or fewer when its tables do not
        hold the KV the next forward pass reads."""

    def need(self, req: Request, tokens: int) -> int:
        """Fresh blocks ``req`` needs for its tables to cover its first ``tokens``
        positions, from its ``num_computed_tokens``. A window group first frees the
        blocks its window no longer reads (mutates the tables and the pool)."""

    def scheduled(self, req: Request, new: list[int], n_new: int) -> ScheduledRequest:
        """Place ``new`` (the blocks :meth:`need` asked for, fresh from the pool) in
        ``req``'s tables; the step computing ``n_new`` tokens as the scheduler half
        is told it (the whole tables when ``req.whole_allocation_next``, else the
        blocks added). Advances ``req.num_computed_tokens`` by ``n_new``."""

    def tables(self, req: Request) -> Sequence[Sequence[int]]:
        """``req``'s tables, one per group, as the scheduler half takes them."""

    def release(self, req: Request) -> None:
        """Free every block ``req`` holds; its tables are empty afterwards."""


class OneTable:
    """The reference :class:`Tables`: one full-attention group; the table is
    ``req.block_ids``, a block for every position."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size

    def cached(self, req: Request) -> CachedPrefix:
        bs = self.block_size
        blocks = self.pool.cached_prefix(req.block_hashes[: (req.num_tokens - 1) // bs])
        return CachedPrefix(len(blocks) * bs, (blocks,))

    def admit(self, req: Request, hit: CachedPrefix, tokens: int, computed: int) -> bool:
        pool, local_blocks = self.pool, hit.blocks[0]
        need = -(-tokens // self.block_size) - len(local_blocks)
        if pool.num_free < need + sum(1 for b in local_blocks if pool.ref[b] == 0):
            return False
        pool.acquire(local_blocks)
        req.block_ids = local_blocks + (pool.allocate(need) or [])
        return True

    def resume(self, req: Request, computed: int) -> int:
        return computed

    def need(self, req: Request, tokens: int) -> int:
        return -(-tokens // self.block_size) - len(req.block_ids)

    def scheduled(self, req: Request, new: list[int], n_new: int) -> ScheduledRequest:
        req.block_ids += new
        whole = req.whole_allocation_next
        req.whole_allocation_next = False
        sched = ScheduledRequest(
            req.request_id,
            req.num_computed_tokens,
            n_new,
            (tuple(req.block_ids) if whole else tuple(new),),
            replace=whole,
        )
        req.num_computed_tokens += n_new
        return sched

    def tables(self, req: Request) -> Sequence[Sequence[int]]:
        return (req.block_ids,)

    def release(self, req: Request) -> None:
        self.pool.release(req.block_ids)
        req.block_ids = []
