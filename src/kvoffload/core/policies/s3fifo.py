"""S3-FIFO (Yang et al., SOSP'23): a small probationary FIFO, a main FIFO, a ghost FIFO.

New chunks enter the small queue S (target 10% of capacity) unless their key is a
ghost, in which case they enter the main queue M. ``touch`` bumps a 2-bit use
counter. Evicting from S: a chunk used at least once since insertion (or currently
not evictable, i.e. in use) is promoted to M; otherwise it is evicted and its key
remembered in the ghost queue G (bounded by capacity). Evicting from M: a chunk with
a positive counter is reinserted with the counter decremented; a chunk that is not
evictable is reinserted; otherwise it is evicted. All queue operations are O(1);
each reinsertion is paid for by an earlier touch, so eviction is amortized O(1).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from itertools import chain

from kvoffload.core.errors import ContractViolation
from kvoffload.core.keys import ChunkKey
from kvoffload.core.policies.base import Evictable, EvictionPolicy

_MAX_FREQ = 3


def _oldest(queue: OrderedDict[ChunkKey, int]) -> ChunkKey:
    return next(iter(queue))


class S3FIFOPolicy(EvictionPolicy):
    """Quick demotion of one-hit chunks, lazy promotion of reused ones."""

    name = "s3fifo"

    def __init__(self, capacity: int, small_fraction: float = 0.1) -> None:
        super().__init__(capacity)
        self.small_target = max(1, int(capacity * small_fraction))
        self.small: OrderedDict[ChunkKey, int] = OrderedDict()
        self.main: OrderedDict[ChunkKey, int] = OrderedDict()
        self.ghost: OrderedDict[ChunkKey, None] = OrderedDict()

    def insert(self, key: ChunkKey) -> None:
        if key in self.ghost:
            del self.ghost[key]
            self.main[key] = 0
        else:
            self.small[key] = 0

    def touch(self, key: ChunkKey) -> None:
        if key in self.small:
            self.small[key] = min(_MAX_FREQ, self.small[key] + 1)
        elif key in self.main:
            self.main[key] = min(_MAX_FREQ, self.main[key] + 1)

    def remove(self, key: ChunkKey) -> None:
        self.small.pop(key, None)
        self.main.pop(key, None)

    def evict(self, n: int, evictable: Evictable) -> list[ChunkKey]:
        victims: list[ChunkKey] = []
        while len(victims) < n:
            prefer_small = len(self.small) > self.small_target or not self.main
            # A pass over S may promote S's last evictable chunks into M: when M was
            # tried first, it is tried again after S.
            attempts = (
                (self._evict_small, self._evict_main)
                if prefer_small
                else (self._evict_main, self._evict_small, self._evict_main)
            )
            victim = None
            for attempt in attempts:
                victim = attempt(evictable)
                if victim is not None:
                    break
            if victim is None:  # the caller promised n evictable chunks
                raise ContractViolation(f"s3fifo: asked for {n} victims, found {len(victims)}")
            victims.append(victim)
        return victims

    def _evict_small(self, evictable: Evictable) -> ChunkKey | None:
        while self.small:
            key = _oldest(self.small)
            freq = self.small.pop(key)
            if freq > 0 or not evictable(key):
                self.main[key] = 0
                continue
            self.ghost[key] = None
            while len(self.ghost) > self.capacity:
                self.ghost.popitem(last=False)
            return key
        return None

    def _evict_main(self, evictable: Evictable) -> ChunkKey | None:
        budget = (_MAX_FREQ + 2) * len(self.main) + 1
        while self.main and budget > 0:
            budget -= 1
            key = _oldest(self.main)
            freq = self.main[key]
            if not evictable(key):
                self.main.move_to_end(key)
            elif freq > 0:
                self.main[key] = freq - 1
                self.main.move_to_end(key)
            else:
                del self.main[key]
                return key
        return None

    def __contains__(self, key: object) -> bool:
        return key in self.small or key in self.main

    def __len__(self) -> int:
        return len(self.small) + len(self.main)

    def __iter__(self) -> Iterator[ChunkKey]:
        return chain(self.small, self.main)

    def clear(self) -> None:
        self.small.clear()
        self.main.clear()
        self.ghost.clear()
