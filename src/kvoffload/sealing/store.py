"""Any lower tier's store with its chunks sealed (decision 0024).

:class:`SealedStore` wraps a tier's :class:`~kvoffload.tiers.spec.TierStore` opened
for chunks of ``chunk_bytes`` + :data:`~.layout.SEAL_BYTES` (the tier builds size it
so, both halves alike): the tier lane and the staged loads keep handing it chunks as
the tier's codec keeps them, and the tier below sees only sealed bytes.

- ``write_many``: each chunk is sealed (a fresh nonce, bound to its storage key, the
  namespace, its group) into a scratch buffer of the calling thread, and the sealed
  bytes are written by the tier below, which adds its own header and checksum;
- ``read_many``: the tier below reads and verifies its own format into scratch
  buffers; each chunk read is opened into the caller's buffer. A chunk that does not
  open fails alone as ``integrity:seal`` and is deleted from the tier when the tier
  can delete (Redis); the scheduler half forgets the copy either way, and the engine
  recomputes. The caller's buffer of a failed chunk may hold partial plaintext, never
  read as a chunk (as with any failed read).

Failures of the tier below (per chunk, or raised for the whole tier) pass through
unchanged. Everything else (``hold``, ``close``, ``delete_many``...) is the wrapped
store's. Called from the tier lane's threads: each thread has its own scratch buffers
(grown to the largest call it made), so calls on different threads never share one.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from itertools import repeat
from typing import Any

from kvoffload.core.failures import ChunkFailure, integrity_failure
from kvoffload.core.keys import ChunkKey, shard_key
from kvoffload.sealing.layout import SEAL_BYTES, SealContext
from kvoffload.sealing.sealer import Sealer, SealError
from kvoffload.tiers.spec import TierStore

SEAL_REASON = "seal"
"""The integrity reason of a chunk that does not open (``integrity:seal``)."""


class SealedStore:
    """``inner`` (a tier holding sealed chunks of at most ``chunk_bytes`` + seal) as
    its callers see it: chunks of at most ``chunk_bytes`` (module docstring).
    ``namespace``: the namespace's digest; ``rank``: the worker's rank (the storage
    key's); ``groups``: the layout's KV cache groups."""

    def __init__(
        self,
        inner: TierStore,
        sealer: Sealer,
        *,
        chunk_bytes: int,
        namespace: bytes,
        rank: int,
        groups: int = 1,
    ) -> None:
        self.inner = inner
        self.sealer = sealer
        self.chunk_bytes = chunk_bytes
        self.namespace = namespace
        self.rank = rank
        self.groups = groups
        self._local = threading.local()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def context(self, key: ChunkKey, group: int) -> SealContext:
        return SealContext(self.namespace, shard_key(key, self.rank), group, self.groups)

    def _scratch(self, count: int) -> list[memoryview]:
        """``count`` buffers of a sealed chunk's size, the calling thread's own."""
        buffers: list[memoryview] = getattr(self._local, "buffers", [])
        while len(buffers) < count:
            buffers.append(memoryview(bytearray(self.chunk_bytes + SEAL_BYTES)))
        self._local.buffers = buffers
        return buffers[:count]

    def write_many(
        self,
        items: Sequence[tuple[ChunkKey, memoryview]],
        slots: Sequence[int],
        groups: Sequence[int] = (),
    ) -> list[ChunkFailure | None]:
        each = groups or repeat(0, len(items))
        sealed: list[tuple[ChunkKey, memoryview]] = []
        for (key, view), group, out in zip(items, each, self._scratch(len(items)), strict=False):
            size = self.sealer.seal_into(view, out, self.context(key, group))
            sealed.append((key, out[:size]))
        return self.inner.write_many(sealed, slots, groups)

    def read_many(
        self,
        keys: Sequence[ChunkKey],
        slots: Sequence[int],
        outs: Sequence[memoryview],
        groups: Sequence[int] = (),
    ) -> list[ChunkFailure | None]:
        buffers = self._scratch(len(keys))
        failures = self.inner.read_many(keys, slots, buffers, groups)
        each = groups or repeat(0, len(keys))
        bad: list[ChunkKey] = []
        for i, (key, group) in enumerate(zip(keys, each, strict=False)):
            if failures[i] is not None:
                continue
            try:
                self.sealer.open_into(buffers[i], outs[i], self.context(key, group))
            except SealError:
                failures[i] = integrity_failure(SEAL_REASON)
                bad.append(key)
        if bad:
            delete = getattr(self.inner, "delete_many", None)
            if delete is not None:
                delete(bad)
        return failures
