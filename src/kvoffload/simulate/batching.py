"""The simulator's batcher strategies: the reference decisions, without the scans.

- :class:`TrackedHolders` (:class:`~kvoffload.engine.strategies.Holders`): waiting
  requests hold blocks only after an admission that issued a load, so those are
  remembered and filtered, in queue order, instead of scanning the whole queue (the
  reference scans it for every running request); the answers are the same lists.
- :class:`RegisterNew` (:class:`~kvoffload.engine.strategies.Registration`): the
  reference registration, skipping a request's leading blocks already registered.
- :class:`Admissions`: the batcher's ``on_admitted`` observer, recording each
  request's first admission and counting re-admissions after preemption.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.engine.block_pool import BlockPool
from kvoffload.engine.request import Request, Status
from kvoffload.engine.strategies import RegisterFull
from kvoffload.simulate.request import SimRequest

_WAITING = (Status.WAITING, Status.WAITING_FOR_LOAD)


class TrackedHolders:
    """See the module docstring. Owned by one batcher; holds the requests admitted
    with a load until they no longer hold blocks while waiting."""

    def __init__(self) -> None:
        self._holding: list[Request] = []

    def admitted(self, req: Request) -> None:
        if req.block_ids and req.status is Status.WAITING_FOR_LOAD and req not in self._holding:
            self._holding.append(req)

    def idle(self, waiting: Sequence[Request]) -> list[Request]:
        if not self._holding:
            return []
        idle = [
            r
            for r in self._live()
            if r.status is not Status.WAITING_FOR_LOAD or r.load_ok is not None
        ]
        if len(idle) > 1:
            idle.sort(key=waiting.index)
        return idle

    def loading(self, waiting: Sequence[Request]) -> bool:
        return any(r.status is Status.WAITING_FOR_LOAD and r.load_ok is None for r in self._live())

    def _live(self) -> list[Request]:
        """Forget the requests that no longer hold blocks while waiting."""
        self._holding = [r for r in self._holding if r.block_ids and r.status in _WAITING]
        return self._holding


class RegisterNew:
    """The reference registration (:class:`RegisterFull`), skipping the leading
    blocks of a :class:`SimRequest` already registered under their own hash (for
    those it is a no-op: a block held by a request keeps its hash). The skip is
    forgotten when the request's block list is replaced (admission, preemption).
    Mutates the pool's prefix cache and the request's ``cached_*`` fields."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._reference = RegisterFull(pool, block_size)

    def register(self, req: Request) -> None:
        if not isinstance(req, SimRequest):
            self._reference.register(req)
            return
        if req.status is Status.WAITING_FOR_LOAD or req.done or not self.pool.caching:
            return
        if req.cached_list is not req.block_ids:
            req.cached_list, req.cached_upto = req.block_ids, 0
        full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes))
        start = req.cached_upto
        if start >= full:
            return
        blocks, hashes = req.block_ids, req.block_hashes
        pool = self.pool
        pool.cache(blocks[start:full], hashes[start:full])
        hash_of = pool.hash_of
        while start < full and hash_of[blocks[start]] == hashes[start]:
            start += 1
        req.cached_upto = start


class Admissions:
    """Counts admissions (see the module docstring); mutates the admitted
    :class:`SimRequest`'s ``admissions`` and ``first_*`` fields."""

    def __init__(self) -> None:
        self.readmissions = 0
        self.readmission_external = 0  # tokens loaded when re-admitted after preemption

    def record(self, req: Request) -> None:
        """``req`` was just admitted by a lookup (its local hit and load are set)."""
        if not req.block_ids or not isinstance(req, SimRequest):
            return
        external = req.load[1] if req.load is not None else 0
        if req.admissions == 0:
            req.first_local, req.first_external = req.num_computed_tokens, external
        else:
            self.readmissions += 1
            self.readmission_external += external
        req.admissions += 1
