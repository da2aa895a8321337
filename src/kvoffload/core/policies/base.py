"""The eviction-policy interface.

A policy owns *ordering* only: which resident chunk to evict next. The directory
owns states and pins and tells the policy, through the ``evictable`` predicate,
which chunks it may choose. Contract between the two:

- ``insert(key)``: ``key`` just became readable (most recent). Not already present.
- ``touch(key)``: ``key`` was used. Ignored if not present.
- ``remove(key)``: ``key`` left the tier for a reason other than eviction (a failed
  store, a reset). Policies with ghost history do not remember it.
- ``evict(n, evictable)``: choose exactly ``n`` distinct present keys, all with
  ``evictable(key)`` true, remove them (remembering them as ghosts where the policy
  keeps history) and return them in eviction order. The caller (the directory)
  guarantees that at least ``n`` evictable keys are present, which makes eviction
  all-or-nothing; a policy that still cannot find ``n`` raises
  :class:`~kvoffload.core.errors.ContractViolation` before removing anything. While
  searching, a policy may reorder its queues (S3-FIFO's promotions and
  reinsertions) but never drops a non-victim.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import ClassVar

from kvoffload.core.errors import ContractViolation
from kvoffload.core.keys import ChunkKey

Evictable = Callable[[ChunkKey], bool]


class EvictionPolicy(ABC):
    """Base class of every eviction policy; see the module docstring for the contract."""

    name: ClassVar[str]

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ContractViolation(f"policy capacity must be positive, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def insert(self, key: ChunkKey) -> None: ...

    @abstractmethod
    def touch(self, key: ChunkKey) -> None: ...

    @abstractmethod
    def remove(self, key: ChunkKey) -> None: ...

    @abstractmethod
    def evict(self, n: int, evictable: Evictable) -> list[ChunkKey]: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[ChunkKey]:
        """Resident keys (any order)."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every key, ghost history included."""


def take_oldest(
    queue: dict[ChunkKey, int] | dict[ChunkKey, None],
    n: int,
    evictable: Evictable,
    exclude: set[ChunkKey],
) -> list[ChunkKey]:
    """Up to ``n`` evictable keys of ``queue`` (oldest first) not in ``exclude``."""
    out: list[ChunkKey] = []
    if n <= 0:
        return out
    for key in queue:
        if key not in exclude and evictable(key):
            out.append(key)
            if len(out) == n:
                break
    return out
