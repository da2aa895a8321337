"""Least recently used."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from kvoffload.core.errors import ContractViolation
from kvoffload.core.keys import ChunkKey
from kvoffload.core.policies.base import Evictable, EvictionPolicy, take_oldest


class LRUPolicy(EvictionPolicy):
    """Evicts the least recently inserted-or-touched evictable chunk first."""

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[ChunkKey, None] = OrderedDict()

    def insert(self, key: ChunkKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: ChunkKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: ChunkKey) -> None:
        self._order.pop(key, None)

    def evict(self, n: int, evictable: Evictable) -> list[ChunkKey]:
        victims = take_oldest(self._order, n, evictable, set())
        if len(victims) != n:
            raise ContractViolation(f"lru: asked for {n} victims, only {len(victims)} evictable")
        for key in victims:
            del self._order[key]
        return victims

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[ChunkKey]:
        return iter(self._order)

    def clear(self) -> None:
        self._order.clear()
