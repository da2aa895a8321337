"""The KV cache groups of stored chunks, as their headers name them.

A hybrid model stores one chunk per KV cache group and chunk of tokens, each under
its own key (:mod:`kvoffload.core.kv_groups`); a key does not tell its group, the
chunk header does (:func:`~kvoffload.core.chunk_format.header_group`). Chunks
written before the header named a group read as group 0 of a one-group layout, as
does every chunk of a one-group layout today.

:class:`GroupTally` remembers the group of each chunk whose header names one other
than 0 (a one-group namespace costs nothing per chunk) and the most groups a header
names; :meth:`GroupTally.per_group` counts chunks by group. Pure accumulator, no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from kvoffload.core.chunk_format import header_group


class GroupTally:
    """Each chunk's KV cache group, from the headers of its shares (the first share
    naming a group other than 0 decides)."""

    def __init__(self) -> None:
        self._groups: dict[bytes, int] = {}
        self.layout = 1  # the most KV cache groups a header named

    def note(self, key: bytes, header: bytes | memoryview) -> None:
        """One share of chunk ``key`` whose ``header`` (at least the 64 header bytes)
        starts with the magic."""
        group, groups = header_group(header)
        self.layout = max(self.layout, groups)
        if group:
            self._groups.setdefault(key, group)

    def per_group(self, chunks: Iterable[bytes]) -> dict[int, int]:
        """How many of ``chunks`` each group holds, by group: every group of the
        largest layout a header named (0 included, also with no chunk at all), and
        any other group a header named."""
        groups = self._groups
        counts = Counter(groups.get(key, 0) for key in chunks)
        for group in range(self.layout):
            counts.setdefault(group, 0)
        return dict(sorted(counts.items()))
