"""The disk tier behind the worker's tier interface (per-chunk results)."""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.core.chunk_format import IntegrityError
from kvoffload.core.keys import ChunkKey
from kvoffload.tiers.disk import DiskStore


class DiskTierStore:
    """Adapts :class:`DiskStore` to ``write_many`` / ``read_many`` / ``delete_many``
    with a failure reason per chunk (``"io:<error>"``, ``"missing"``,
    ``"integrity:<reason>"``); a bad file is deleted where it was found."""

    def __init__(self, store: DiskStore) -> None:
        self.store = store

    def write_many(self, items: Sequence[tuple[ChunkKey, memoryview]]) -> list[str | None]:
        failures: list[str | None] = []
        for key, payload in items:
            try:
                self.store.write(key, payload)
            except OSError as exc:
                failures.append(f"io:{exc.strerror or type(exc).__name__}")
            else:
                failures.append(None)
        return failures

    def read_many(self, keys: Sequence[ChunkKey], outs: Sequence[memoryview]) -> list[str | None]:
        failures: list[str | None] = []
        for key, out in zip(keys, outs, strict=True):
            try:
                self.store.read_into(key, out)
            except FileNotFoundError:
                failures.append("missing")
            except IntegrityError as exc:
                self.store.delete(key)
                failures.append(f"integrity:{exc.reason.value}")
            except OSError as exc:
                failures.append(f"io:{exc.strerror or type(exc).__name__}")
            else:
                failures.append(None)
        return failures

    def delete_many(self, keys: Sequence[ChunkKey]) -> None:
        for key in keys:
            self.store.delete(key)
