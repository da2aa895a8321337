"""Segmented LRU with a ghost history: a probation segment for chunks not reused
since they were stored, a protected segment for chunks used again.

A stored chunk enters *probation* (most recent), unless its key is a *ghost* (it was
evicted from here not long ago and has now been stored again: it was wanted after
all), in which case it enters *protected*. ``touch`` of a probation chunk moves it to
protected (most recent); ``touch`` of a protected chunk refreshes it there. The
protected segment holds at most ``protected_fraction`` of ``capacity`` chunks: when
it overflows, its least recently used chunks are demoted to the most recent end of
probation (a second chance, never an eviction). Eviction takes the oldest evictable
probation chunks first, then the oldest evictable protected ones, and remembers the
victims as ghosts: at most ``capacity`` keys, the oldest forgotten first. ``remove``
forgets a key without making it a ghost; ``clear`` forgets the ghosts too.

Why: most stored chunks are never read again (in Mooncake's conversation trace
three quarters of the distinct 512-token blocks are used once), while a chunk that
has been reused is reused again far more often (42% against 26% after one reuse,
more after each). Plain LRU lets a stream of one-off prefixes push the reused
prefixes out; here one-off chunks can only displace other probation chunks and what
overflows the protected quarter. Decision 0014 has the measurements.

Cost: three ordered dicts: one entry per resident chunk and at most ``capacity``
ghost keys (ARC keeps as many). ``insert``, ``touch`` and ``remove`` are O(1)
(each adds at most one chunk to protected, so an overflow demotes one);
``evict`` is O(victims + skipped non-evictable chunks), as LRU's.
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
        self.ghost: OrderedDict[ChunkKey, None] = OrderedDict()

    def insert(self, key: ChunkKey) -> None:
        if key in self.ghost:  # stored again after an eviction: a reuse
            del self.ghost[key]
            self._protect(key)
        else:
            self.probation[key] = None

    def touch(self, key: ChunkKey) -> None:
        if key in self.protected:
            self.protected.move_to_end(key)
            return
        if key not in self.probation:
            return
        del self.probation[key]
        self._protect(key)

    def _protect(self, key: ChunkKey) -> None:
        """``key`` (in no segment) becomes the most recent protected chunk; an
        overflow demotes the least recently used one to probation."""
        self.protected[key] = None
        while len(self.protected) > self.protected_limit:
            demoted, _ = self.protected.popitem(last=False)
            self.probation[demoted] = None

    def remove(self, key: ChunkKey) -> None:
        self.probation.pop(key, None)
        self.protected.pop(key, None)

    def evict(self, n: int, evictable: Evictable) -> list[ChunkKey]:
        probation, protected, ghost = self.probation, self.protected, self.ghost
        victims = take_oldest(probation, n, evictable, set())
        if len(victims) < n:
            victims += take_oldest(protected, n - len(victims), evictable, set())
            if len(victims) != n:
                raise ContractViolation(
                    f"slru: asked for {n} victims, only {len(victims)} evictable"
                )
        for key in victims:
            if key in probation:
                del probation[key]
            else:
                del protected[key]
            ghost[key] = None
        while len(ghost) > self.capacity:
            ghost.popitem(last=False)
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
        self.ghost.clear()
