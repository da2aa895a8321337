"""Admission by reuse: store a chunk only once enough requests asked for it.

With ``store_threshold`` N >= 2 a chunk is admitted after N recorded lookups (one
per request that wanted it), which keeps one-off prompts from pushing reusable
prefixes out. Memory is bounded: at most ``max_counters`` keys are counted, the
least recently counted forgotten first. Owned and mutated by one directory
(:class:`~kvoffload.core.directory.Directory`); it holds no reference to it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence

from kvoffload.core.config.own_options import default
from kvoffload.core.errors import ConfigError
from kvoffload.core.keys import ChunkKey

MAX_ADMISSION_COUNTERS = 65536
"""How many keys an admission filter counts unless told otherwise (a directory's,
a share's: ``ShareGeometry.max_admission_counters``)."""


class AdmissionFilter:
    """Bounded per-key lookup counters and the admission rule over them."""

    def __init__(
        self,
        store_threshold: int = default("store_threshold"),
        max_counters: int = MAX_ADMISSION_COUNTERS,
    ) -> None:
        if not isinstance(store_threshold, int) or store_threshold < 1:
            raise ConfigError(
                "store_threshold", f"must be an integer >= 1, got {store_threshold!r}"
            )
        if not isinstance(max_counters, int) or max_counters < 1:
            raise ConfigError(
                "max_admission_counters", f"must be a positive integer, got {max_counters!r}"
            )
        self.store_threshold = store_threshold
        self.max_counters = max_counters
        self._counts: OrderedDict[ChunkKey, int] = OrderedDict()

    @property
    def active(self) -> bool:
        """False when every chunk is admitted (threshold 1): nothing is counted."""
        return self.store_threshold > 1

    def record(self, keys: Iterable[ChunkKey]) -> None:
        counts = self._counts
        for key in keys:
            counts[key] = counts.get(key, 0) + 1
            counts.move_to_end(key)
        while len(counts) > self.max_counters:
            counts.popitem(last=False)

    def admits(self, key: ChunkKey) -> bool:
        return not self.active or self._counts.get(key, 0) >= self.store_threshold

    def forget(self, key: ChunkKey) -> None:
        """Drop ``key``'s counter (it was stored)."""
        self._counts.pop(key, None)

    def clear(self) -> None:
        self._counts.clear()

    def __len__(self) -> int:
        return len(self._counts)


def sort_store_keys(
    keys: Sequence[ChunkKey],
    present: Container[ChunkKey],
    in_flight: Container[ChunkKey],
    admission: AdmissionFilter | None,
) -> tuple[list[ChunkKey], list[ChunkKey], list[ChunkKey]]:
    """(new, refused, present) keys of a store of ``keys``, each once, in order:
    present ones are skipped, ones whose discarded copy is still ``in_flight`` too
    (stored again later), and without an ``admission`` filter (a chunk coming back
    from a lower tier was admitted once) every other key is new."""
    seen: set[ChunkKey] = set()
    new: list[ChunkKey] = []
    refused: list[ChunkKey] = []
    found: list[ChunkKey] = []
    for key in keys:
        if key in seen:
            continue
        seen.add(key)
        if key in present:
            found.append(key)
        elif key in in_flight:
            continue
        elif admission is not None and not admission.admits(key):
            refused.append(key)
        else:
            new.append(key)
    return new, refused, found
