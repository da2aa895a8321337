"""Segmented LRU: a probation segment for chunks not yet reused, a protected
segment for chunks used again since they were stored.

A stored chunk enters *probation* (most recent). ``touch`` of a probation chunk
moves it to *protected* (most recent); ``touch`` of a protected chunk refreshes it
there. The protected segment holds at most ``protected_fraction`` of ``capacity``
chunks: when a promotion overflows it, its least recently used chunks are demoted
to the most recent end of probation (a second chance, never an eviction).
Eviction takes the oldest evictable probation chunks first, then the oldest
evictable protected ones. No ghost history is kept: ``remove`` and ``evict``
forget the key.

Why: most stored chunks are never read again (in Mooncake's conversation trace
three quarters of the distinct 512-token blocks are used once), while a chunk
that has been reused once is reused again far more often (42% against 26%, more
after each reuse). Plain LRU lets a stream of one-off prefixes push the reused
prefixes out; here one-off chunks can only displace other probation chunks and
the protected quarter. Decision 0014 has the measurements.

Cost: two ordered dicts, one entry per resident chunk (no more memory than LRU);
``insert``, ``touch`` and ``remove`` are O(1) (a promotion demotes at most one
chunk, the segment being full only by one); ``evict`` is O(victims + skipped
non-evictable chunks), as LRU's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from itertools import chain

from kvoffload.core.errors import ContractViolation
from kvoffload.core.keys import ChunkKey
from kvoffload.core.policies.base import Evictable, EvictionPolicy, take_oldest

PROTECTED_FRACTION = 0.25
"""Default share of the capacity the protected segment may hold (decision 0014)."""


class SLRUPolicy(EvictionPolicy):
    """Evicts chunks never reused since they were stored before reused ones, each
    segment least recently used first; see the module docstring."""

    name = "slru"

    def __init__(self, capacity: int, protected_fraction: float = PROTECTED_FRACTION) -> None:
        super().__init__(capacity)
        if not 0.0 <= protected_fraction <= 1.0:
            raise ContractViolation(
                f"slru: protected_fraction must be in [0, 1], got {protected_fraction}"
            )
        self.protected_limit = int(capacity * protected_fraction)
        self.probation: OrderedDict[ChunkKey, None] = OrderedDict()
        self.protected: OrderedDict[ChunkKey, None] = OrderedDict()

    def insert(self, key: ChunkKey) -> None:
        self.protected.pop(key, None)
        self.probation[key] = None
        self.probation.move_to_end(key)

    def touch(self, key: ChunkKey) -> None:
        if key in self.protected:
            self.protected.move_to_end(key)
            return
        if key not in self.probation:
            return
        del self.probation[key]
        self.protected[key] = None
        while len(self.protected) > self.protected_limit:
            demoted, _ = self.protected.popitem(last=False)
            self.probation[demoted] = None

    def remove(self, key: ChunkKey) -> None:
        self.probation.pop(key, None)
        self.protected.pop(key, None)

    def evict(self, n: int, evictable: Evictable) -> list[ChunkKey]:
        victims = take_oldest(self.probation, n, evictable, set())
        victims += take_oldest(self.protected, n - len(victims), evictable, set())
        if len(victims) != n:
            raise ContractViolation(f"slru: asked for {n} victims, only {len(victims)} evictable")
        for key in victims:
            self.remove(key)
        return victims

    def __contains__(self, key: object) -> bool:
        return key in self.probation or key in self.protected

    def __len__(self) -> int:
        return len(self.probation) + len(self.protected)

    def __iter__(self) -> Iterator[ChunkKey]:
        return chain(self.probation, self.protected)

    def clear(self) -> None:
        self.probation.clear()
        self.protected.clear()
