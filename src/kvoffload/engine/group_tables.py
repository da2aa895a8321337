"""Block tables of a hybrid model: several KV cache groups in one block pool.

What vLLM's hybrid KV cache manager does, for the reference engine (the rules are
:class:`~kvoffload.core.kv_groups.KVGroup`'s):

- every group has its own table over the one shared pool; a block belongs to one
  group at a time (:attr:`GroupTables.group_of`); pool block 0 is the *null block*
  (:data:`NULL_BLOCK`), taken at construction and never a request's;
- a full-attention group holds a block for every position of the request;
- a window group frees its blocks below the window of the tokens counted computed
  whenever the request is scheduled (:meth:`GroupTables.need`): they go back to the
  pool (keeping their prefix-cache hash until reused) and the table keeps the null
  block in their place; at admission the blocks below the window of the hit and the
  load are never held. A request of ``T`` tokens thus costs each window group at
  most about ``(window + tokens computed in one step) / block_size + 1`` blocks;
- the prefix cache is per group (a block is cached under its hash tagged with its
  group) and a hit is what every group can serve (:meth:`GroupTables.cached`): a full
  group its cached prefix, a window group a point whose window's blocks are cached,
  shrunk to a fixed point as vLLM's hybrid coordinator does.

A request's tables (:class:`RequestTables`) are null blocks first, then blocks it
holds. :class:`GroupTables` is the batcher's :class:`~kvoffload.engine.tables.Tables`
and :class:`~kvoffload.engine.strategies.Registration` at once (both follow the same
per-group rules). The deterministic model reads one table only: give such an engine
another model (the simulator's null model computes no KV).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.core.errors import ContractViolation
from kvoffload.core.kv_groups import KVGroups
from kvoffload.core.scheduler_types import ScheduledRequest
from kvoffload.engine.block_pool import BlockPool
from kvoffload.engine.request import Request, RequestTables, Status
from kvoffload.engine.tables import CachedPrefix

NULL_BLOCK = 0
"""The pool block standing for a block a window group does not hold (vLLM's)."""


class GroupTables:
    """See the module docstring. Takes the null block of ``pool`` (which no request
    may use yet: ValueError otherwise); mutates the pool and the requests' ``groups``
    and ``block_ids`` (the first group's table)."""

    def __init__(self, pool: BlockPool, groups: KVGroups) -> None:
        if pool.num_free != pool.num_blocks or pool.num_blocks < 2:
            raise ValueError("GroupTables needs a block pool of 2 blocks or more, none used")
        if len(groups) > 255:
            raise ValueError("at most 255 KV cache groups")
        self.pool = pool
        self.block_size = pool.block_size
        self.groups = groups.groups
        self.tags = [bytes((g,)) for g in range(len(self.groups))]
        self.group_of = [-1] * pool.num_blocks
        """The group each block was last handed to (-1: never)."""
        pool.acquire([NULL_BLOCK])

    # ------------------------------------------------------------ admission

    def cached(self, req: Request) -> CachedPrefix:
        bs, cached = self.block_size, self.pool.cached
        hashes = req.block_hashes[: (req.num_tokens - 1) // bs]
        hit = len(hashes)
        for g, group in enumerate(self.groups):
            if group.full:
                tag, n = self.tags[g], 0
                while n < hit and hashes[n] + tag in cached:
                    n += 1
                hit = n
        while True:
            before = hit
            for g, group in enumerate(self.groups):
                if not group.full:
                    hit = self._window_hit(g, hashes, hit)
            if hit == before:
                break
        blocks = []
        for g, group in enumerate(self.groups):
            tag, first = self.tags[g], group.skipped_tokens(hit * bs) // bs
            blocks.append([NULL_BLOCK] * first + [cached[h + tag] for h in hashes[first:hit]])
        return CachedPrefix(hit * bs, tuple(blocks))

    def _window_hit(self, group: int, hashes: Sequence[bytes], hit: int) -> int:
        """The largest ``h <= hit`` whose blocks the window of group ``group`` reads
        from ``h`` on are all cached (0 if none)."""
        bs, cached, tag = self.block_size, self.pool.cached, self.tags[group]
        rule = self.groups[group]
        h = hit
        while h > 0:
            first = rule.skipped_tokens(h * bs) // bs
            j = h - 1
            while j >= first and hashes[j] + tag in cached:
                j -= 1
            if j < first:
                return h
            h = j  # every point above j needs block j
        return 0

    def admit(self, req: Request, hit: CachedPrefix, tokens: int, computed: int) -> bool:
        bs, pool = self.block_size, self.pool
        want, local = -(-tokens // bs), hit.tokens // bs
        tables: list[list[int]] = []
        for g, group in enumerate(self.groups):
            live = group.skipped_tokens(computed) // bs
            table = [NULL_BLOCK if i < live else b for i, b in enumerate(hit.blocks[g])]
            tables.append(table + [NULL_BLOCK] * (live - local))
        held = [b for table in tables for b in table if b != NULL_BLOCK]
        fresh = sum(want - len(table) for table in tables)
        if pool.num_free < fresh + sum(1 for b in held if pool.ref[b] == 0):
            return False
        pool.acquire(held)
        new = pool.allocate(fresh) or []
        pos = 0
        for g, table in enumerate(tables):
            pos = self._append(table, new, pos, want - len(table), g)
        req.groups = RequestTables(tables)
        req.block_ids = tables[0]
        return True

    def resume(self, req: Request, computed: int) -> int:
        """``computed``, or 0 when a window group's table lacks a block its window of
        ``computed`` tokens reads (a failed load: blocks below the window of the hit
        were never held): the request then recomputes from the start."""
        rt = req.groups
        if rt is None:
            return computed
        for group, table in zip(self.groups, rt.tables, strict=True):
            live = group.skipped_tokens(computed) // self.block_size
            if not group.full and live < len(table) and table[live] == NULL_BLOCK:
                return 0
        return computed

    # ------------------------------------------------------------ scheduling

    def need(self, req: Request, tokens: int) -> int:
        rt = req.groups
        if rt is None:
            rt = req.groups = RequestTables([[] for _ in self.groups])
            req.block_ids = rt.tables[0]
        bs, computed = self.block_size, req.num_computed_tokens
        want, need = -(-tokens // bs), 0
        for group, table in zip(self.groups, rt.tables, strict=True):
            if not group.full:
                live = group.skipped_tokens(computed) // bs
                self._free_below(table, min(live, len(table)))
                hole = live
                while hole < len(table) and table[hole] == NULL_BLOCK:
                    hole += 1
                need += hole - live
            need += max(0, want - len(table))
        return need

    def scheduled(self, req: Request, new: list[int], n_new: int) -> ScheduledRequest:
        rt = req.groups
        if rt is None:
            raise ContractViolation(f"request {req.request_id!r} scheduled without tables")
        bs, start = self.block_size, req.num_computed_tokens
        want, whole = -(-(start + n_new) // bs), req.whole_allocation_next
        added: list[tuple[int, ...]] = []
        pos = 0
        for g, (group, table) in enumerate(zip(self.groups, rt.tables, strict=True)):
            before = len(table)
            if not group.full:  # the holes of a window that must hold KV again
                i = group.skipped_tokens(start) // bs
                while i < len(table) and table[i] == NULL_BLOCK:
                    table[i] = new[pos]
                    self.group_of[new[pos]] = g
                    pos, i, whole = pos + 1, i + 1, True
            pos = self._append(table, new, pos, want - len(table), g)
            added.append(tuple(table[before:]))
        if pos != len(new):
            raise ContractViolation(f"{len(new)} blocks given, {pos} needed")
        req.whole_allocation_next = False
        blocks = tuple(tuple(t) for t in rt.tables) if whole else tuple(added)
        sched = ScheduledRequest(req.request_id, start, n_new, blocks, replace=whole)
        req.num_computed_tokens += n_new
        return sched

    def tables(self, req: Request) -> Sequence[Sequence[int]]:
        rt = req.groups
        return tuple(tuple(t) for t in rt.tables) if rt is not None else ()

    def release(self, req: Request) -> None:
        rt = req.groups
        if rt is not None:
            for table in rt.tables:
                self.pool.release([b for b in table if b != NULL_BLOCK])
        req.groups = None
        req.block_ids = []

    def held_blocks(self, req: Request) -> list[int]:
        """Blocks per group ``req`` holds (not the null block), in group order."""
        rt = req.groups
        if rt is None:
            return [0] * len(self.groups)
        return [sum(1 for b in t if b != NULL_BLOCK) for t in rt.tables]

    # ------------------------------------------------------------ registration

    def register(self, req: Request) -> None:
        """Register ``req``'s full computed blocks of every group under their group's
        hash (the reference registration per group: a block skipped as a duplicate
        is offered again at later steps, a null block never)."""
        pool, rt = self.pool, req.groups
        if req.status is Status.WAITING_FOR_LOAD or req.done or not pool.caching or rt is None:
            return
        hashes = req.block_hashes
        full = min(req.num_computed_tokens // self.block_size, len(hashes))
        hash_of = pool.hash_of
        for g, table in enumerate(rt.tables):
            i = rt.registered[g]
            if i >= full:
                continue
            tag = self.tags[g]
            rows = zip(table[i:full], hashes[i:full], strict=True)
            pairs = [(b, h + tag) for b, h in rows if b != NULL_BLOCK]
            pool.cache([b for b, _ in pairs], [h for _, h in pairs])
            while i < full and (table[i] == NULL_BLOCK or hash_of[table[i]] == hashes[i] + tag):
                i += 1
            rt.registered[g] = i

    # ------------------------------------------------------------ helpers

    def _append(self, table: list[int], new: list[int], pos: int, n: int, group: int) -> int:
        """Append ``new[pos:pos + n]`` (n <= 0: nothing) to ``table`` as ``group``'s."""
        if n <= 0:
            return pos
        more = new[pos : pos + n]
        if len(more) != n:
            raise ContractViolation(f"{len(new)} blocks given, more needed")
        for b in more:
            self.group_of[b] = group
        table += more
        return pos + n

    def _free_below(self, table: list[int], stop: int) -> None:
        """Free the held blocks of ``table`` below index ``stop``; null them."""
        i = stop - 1
        while i >= 0 and table[i] != NULL_BLOCK:
            i -= 1
        if i + 1 < stop:
            self.pool.release(table[i + 1 : stop])
            table[i + 1 : stop] = [NULL_BLOCK] * (stop - i - 1)
