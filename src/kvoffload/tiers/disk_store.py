"""The disk tier behind the worker's tier interface (per-chunk results)."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat

from kvoffload.core.chunk_format import IntegrityError
from kvoffload.core.failures import ChunkFailure, integrity_failure, io_failure
from kvoffload.core.keys import ChunkKey
from kvoffload.tiers.disk import DiskStore


class DiskTierStore:
    """Adapts :class:`DiskStore` to ``write_many`` / ``read_many`` with a failure
    :class:`~kvoffload.core.failures.ChunkFailure` per chunk (``IO`` with the OS
    error, ``INTEGRITY`` with the :class:`IntegrityReason` value); a slot found bad
    is cleared where it was found. Disk chunks always carry their tier slot.
    ``groups``: each chunk's KV cache group, written into its header and expected
    back when it is read (empty: every chunk is group 0)."""

    def __init__(self, store: DiskStore) -> None:
        self.store = store

    def write_many(
        self,
        items: Sequence[tuple[ChunkKey, memoryview]],
        slots: Sequence[int],
        groups: Sequence[int] = (),
    ) -> list[ChunkFailure | None]:
        failures: list[ChunkFailure | None] = []
        each = groups or repeat(0, len(items))
        for (key, payload), slot, group in zip(items, slots, each, strict=True):
            try:
                self.store.write(slot, key, payload, group)
            except OSError as exc:
                failures.append(io_failure(exc.strerror or type(exc).__name__))
            else:
                failures.append(None)
        return failures

    def read_many(
        self,
        keys: Sequence[ChunkKey],
        slots: Sequence[int],
        outs: Sequence[memoryview],
        groups: Sequence[int] = (),
    ) -> list[ChunkFailure | None]:
        failures: list[ChunkFailure | None] = []
        each = groups or repeat(0, len(keys))
        for key, slot, out, group in zip(keys, slots, outs, each, strict=True):
            try:
                self.store.read_into(slot, key, out, group)
            except IntegrityError as exc:
                self.store.clear(slot)
                failures.append(integrity_failure(exc.reason.value))
            except OSError as exc:
                failures.append(io_failure(exc.strerror or type(exc).__name__))
            else:
                failures.append(None)
        return failures

    def close(self) -> None:
        self.store.close()
