"""Segmented LRU with a ghost history: chunks used again since they were stored are
protected from chunks not (yet) reused.

Three queues of resident chunks, each in the order of its chunks' last use (a stamp
taken at every ``insert`` and ``touch``):

- *probation*: chunks not used since they were stored;
- *protected*: chunks used again (``touch``), at most ``protected_fraction`` of
  ``capacity``;
- *demoted*: chunks pushed out of protected when a promotion overflowed it, least
  recently used first (protected is in last-use order, so demoted is too).

A stored chunk enters probation, unless its key is a *ghost* (evicted from here not
long ago and stored again: it was wanted after all), in which case it enters
protected. ``touch`` of a chunk in probation or demoted moves it to protected;
``touch`` of a protected chunk refreshes it there. Eviction takes the least recently
used evictable chunk of probation and demoted together (comparing the two queues'
oldest), then of protected, and remembers the victims as ghosts: at most
``capacity`` keys, the oldest forgotten first. Outside the protected share this is
exactly LRU, so a workload where every chunk is reused (a few conversations cycling
through less memory than they need) is served as LRU serves it. ``remove`` forgets a
key without making it a ghost; ``clear`` forgets the ghosts too.

Why: most stored chunks are never read again (in Mooncake's conversation trace
three quarters of the distinct 512-token blocks are used once), while a chunk that
has been reused is reused again far more often (42% against 26% after one reuse,
more after each). Plain LRU lets a stream of one-off prefixes push the reused
prefixes out; here they can only push out other chunks outside the protected
share. Decision 0014 has the measurements.

Cost: four ordered dicts: one entry per resident chunk (its stamp) and at most
``capacity`` ghost keys (ARC keeps as many). ``insert``, ``touch`` and ``remove`` are
O(1) (each adds at most one chunk to protected, so an overflow demotes one);
``evict`` is O(victims + skipped non-evictable chunks), as LRU's.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from itertools import chain

from kvoffload.core.errors import ContractViolation
from kvoffload.core.keys import ChunkKey
from kvoffload.core.policies.base import Evictable, EvictionPolicy, take_oldest

PROTECTED_FRACTION = 0.4
"""Default share of the capacity the protected segment may hold (decision 0014)."""

_Queue = OrderedDict[ChunkKey, int]


class SLRUPolicy(EvictionPolicy):
    """LRU outside a protected share of chunks reused since they were stored; see the
    module docstring."""

    name = "slru"

    def __init__(self, capacity: int, protected_fraction: float = PROTECTED_FRACTION) -> None:
        super().__init__(capacity)
        if not 0.0 <= protected_fraction <= 1.0:
            raise ContractViolation(
                f"slru: protected_fraction must be in [0, 1], got {protected_fraction}"
            )
        self.protected_limit = int(capacity * protected_fraction)
        self.probation: _Queue = OrderedDict()
        self.demoted: _Queue = OrderedDict()
        self.protected: _Queue = OrderedDict()
        self.ghost: OrderedDict[ChunkKey, None] = OrderedDict()
        self._clock = 0

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def insert(self, key: ChunkKey) -> None:
        if key in self.ghost:  # stored again after an eviction: a reuse
            del self.ghost[key]
            self._protect(key)
        else:
            self.probation[key] = self._tick()

    def touch(self, key: ChunkKey) -> None:
        if key in self.protected:
            del self.protected[key]
        elif self.probation.pop(key, None) is None and self.demoted.pop(key, None) is None:
            return
        self._protect(key)

    def _protect(self, key: ChunkKey) -> None:
        """``key`` (in no queue) becomes the most recent protected chunk; an overflow
        demotes the least recently used one."""
        protected = self.protected
        protected[key] = self._tick()
        while len(protected) > self.protected_limit:
            demoted, stamp = protected.popitem(last=False)
            self.demoted[demoted] = stamp

    def remove(self, key: ChunkKey) -> None:
        for queue in (self.probation, self.demoted, self.protected):
            if queue.pop(key, None) is not None:
                return

    def evict(self, n: int, evictable: Evictable) -> list[ChunkKey]:
        probation, demoted, protected = self.probation, self.demoted, self.protected
        if demoted and probation:
            victims = _oldest_of_two(probation, demoted, n, evictable)
        else:
            victims = take_oldest(probation or demoted, n, evictable, set())
        if len(victims) < n:
            victims += take_oldest(protected, n - len(victims), evictable, set())
            if len(victims) != n:
                raise ContractViolation(
                    f"slru: asked for {n} victims, only {len(victims)} evictable"
                )
        ghost = self.ghost
        for key in victims:
            if probation.pop(key, None) is None and demoted.pop(key, None) is None:
                del protected[key]
            ghost[key] = None
        while len(ghost) > self.capacity:
            ghost.popitem(last=False)
        return victims

    def __contains__(self, key: object) -> bool:
        return key in self.probation or key in self.demoted or key in self.protected

    def __len__(self) -> int:
        return len(self.probation) + len(self.demoted) + len(self.protected)

    def __iter__(self) -> Iterator[ChunkKey]:
        return chain(self.probation, self.demoted, self.protected)

    def clear(self) -> None:
        for queue in (self.probation, self.demoted, self.protected):
            queue.clear()
        self.ghost.clear()
        self._clock = 0


def _oldest_of_two(a: _Queue, b: _Queue, n: int, evictable: Evictable) -> list[ChunkKey]:
    """Up to ``n`` evictable keys of ``a`` and ``b`` (each in ascending stamp order),
    smallest stamp first: a merge of the two queues' evictable keys."""
    out: list[ChunkKey] = []
    ia, ib = iter(a.items()), iter(b.items())
    ha = _next_evictable(ia, evictable)
    hb = _next_evictable(ib, evictable)
    while len(out) < n:
        if ha is not None and (hb is None or ha[1] <= hb[1]):
            out.append(ha[0])
            ha = _next_evictable(ia, evictable)
        elif hb is not None:
            out.append(hb[0])
            hb = _next_evictable(ib, evictable)
        else:
            break
    return out


def _next_evictable(
    items: Iterator[tuple[ChunkKey, int]], evictable: Evictable
) -> tuple[ChunkKey, int] | None:
    for item in items:
        if evictable(item[0]):
            return item
    return None
