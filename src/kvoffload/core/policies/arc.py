"""Adaptive Replacement Cache (Megiddo and Modha, FAST'03), adapted to pins.

T1 holds chunks used once since insertion, T2 chunks used again; B1 and B2 remember
keys recently evicted from each (ghosts, keys only). A ghost hit on insert moves the
target size ``p`` of T1 toward the list that would have kept the chunk. Eviction
takes the oldest *evictable* chunk of T1 while T1 is over target, else of T2,
falling back to the other list when the preferred one has nothing evictable.
Ghost lists are bounded: |T1| + |B1| <= capacity and the four lists <= 2 * capacity.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from itertools import chain

from kvoffload.core.errors import ContractViolation
from kvoffload.core.keys import ChunkKey
from kvoffload.core.policies.base import Evictable, EvictionPolicy


class ARCPolicy(EvictionPolicy):
    """Adaptive replacement: balances recency (T1) against frequency (T2)."""

    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.t1: OrderedDict[ChunkKey, None] = OrderedDict()
        self.t2: OrderedDict[ChunkKey, None] = OrderedDict()
        self.b1: OrderedDict[ChunkKey, None] = OrderedDict()
        self.b2: OrderedDict[ChunkKey, None] = OrderedDict()
        self.p = 0.0

    def insert(self, key: ChunkKey) -> None:
        if key in self.b1:
            self.p = min(float(self.capacity), self.p + max(1.0, len(self.b2) / len(self.b1)))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.p = max(0.0, self.p - max(1.0, len(self.b1) / len(self.b2)))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None
        self._trim_ghosts()

    def touch(self, key: ChunkKey) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key: ChunkKey) -> None:
        self.t1.pop(key, None)
        self.t2.pop(key, None)

    def evict(self, n: int, evictable: Evictable) -> list[ChunkKey]:
        from_t1 = (k for k in self.t1 if evictable(k))
        from_t2 = (k for k in self.t2 if evictable(k))
        next1, next2 = next(from_t1, None), next(from_t2, None)
        t1_size = len(self.t1)
        chosen: list[tuple[ChunkKey, bool]] = []
        while len(chosen) < n:
            take_t1 = next1 is not None and (next2 is None or t1_size > self.p)
            if take_t1 and next1 is not None:
                chosen.append((next1, True))
                t1_size -= 1
                next1 = next(from_t1, None)
            elif next2 is not None:
                chosen.append((next2, False))
                next2 = next(from_t2, None)
            else:
                raise ContractViolation(f"arc: asked for {n} victims, only {len(chosen)} evictable")
        for key, in_t1 in chosen:
            if in_t1:
                del self.t1[key]
                self.b1[key] = None
            else:
                del self.t2[key]
                self.b2[key] = None
        self._trim_ghosts()
        return [key for key, _ in chosen]

    def _trim_ghosts(self) -> None:
        while self.b1 and len(self.t1) + len(self.b1) > self.capacity:
            self.b1.popitem(last=False)
        total = len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2)
        while self.b2 and total > 2 * self.capacity:
            self.b2.popitem(last=False)
            total -= 1
        while self.b1 and total > 2 * self.capacity:
            self.b1.popitem(last=False)
            total -= 1

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __iter__(self) -> Iterator[ChunkKey]:
        return chain(self.t1, self.t2)

    def clear(self) -> None:
        for od in (self.t1, self.t2, self.b1, self.b2):
            od.clear()
        self.p = 0.0
