"""Host memory of several simulated replicas: the shared tier and the memory ledger.

- :class:`SharedHost` is the host :class:`~kvoffload.core.directory.Directory` (a
  :class:`~kvoffload.core.directory.HostDirectory`, checked statically below) that
  every replica's scheduler half uses when they share one tier (``--host-share``): one
  index, one eviction policy, one admission filter. Whoever stores a chunk, every
  replica hits it once its store completed. It remembers which replica prepared each
  chunk's store and counts the stores it spared: a replica offering a chunk another
  replica holds (``found_present``) or is storing (``found_storing``) copies nothing
  (the directory skips present keys), where its private tier would hold a copy of its
  own; each (replica, chunk) is counted once, however often it is offered again.
  The driver names the replica whose scheduler half runs (:attr:`SharedHost.current`)
  before every call into it.
- :class:`HostLedger` follows the host directories of a run (one shared, or one per
  replica) through their cache events and measures what they hold: the slots used at
  peak (STORING included), and the *extra copies*: chunks held readable in more than
  one private tier (each chunk counted once less than its copies), now and at most,
  the memory one shared tier would not spend on duplicates. It drains the directories' events (the
  simulator has no other reader of them).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvoffload.core.chunk_state import ChunkState
from kvoffload.core.directory import Directory, HostDirectory, PreparedStore
from kvoffload.core.keys import ChunkKey
from kvoffload.core.observe.events import EventKind


class SharedHost(Directory):
    """A host directory shared by ``replicas`` scheduler halves (module docstring).

    Owns, besides the directory's state, the store owner of every chunk it allocated
    (kept until the key is stored again, read only for present keys), the (replica,
    chunk) pairs counted and the spared stores per replica. ``current`` is set by
    the driver; nothing else changes. ``tier`` and ``max_admission_counters`` are
    the directory's."""

    def __init__(
        self,
        num_slots: int,
        replicas: int,
        *,
        policy: str,
        store_threshold: int,
        tier: str = "host",
        max_admission_counters: int = 65536,
    ) -> None:
        super().__init__(
            num_slots,
            tier=tier,
            policy=policy,
            store_threshold=store_threshold,
            max_admission_counters=max_admission_counters,
        )
        self.current = 0
        self.owner: dict[ChunkKey, int] = {}
        self._spared: set[tuple[int, ChunkKey]] = set()  # (replica, key) counted
        self.found_present = [0] * replicas
        self.found_storing = [0] * replicas

    def prepare_store(
        self,
        keys: Sequence[ChunkKey],
        *,
        admit_all: bool = False,
        groups: Sequence[int] | None = None,
    ) -> PreparedStore:
        """:meth:`Directory.prepare_store`, counting the keys skipped because another
        replica holds or is storing them (a call without room changes and counts
        nothing: its keys are offered again)."""
        prepared = super().prepare_store(keys, admit_all=admit_all, groups=groups)
        if prepared.no_room:
            return prepared
        me = self.current
        for key in prepared.keys:
            self.owner[key] = me
        new = set(prepared.keys)
        for key in keys:
            if key in new or self.owner.get(key, me) == me or (me, key) in self._spared:
                continue
            self._spared.add((me, key))
            state = self.state_of(key)
            if state is ChunkState.STORING:
                self.found_storing[me] += 1
            elif state is not ChunkState.FREE:
                self.found_present[me] += 1
        return prepared


class HostLedger:
    """What the host directories of a run hold (module docstring). Owns its counts;
    reads the directories and drains their events in :meth:`observe`."""

    def __init__(self, directories: Sequence[HostDirectory]) -> None:
        self.directories = list(directories)
        self.copies: Counter[ChunkKey] = Counter()  # readable copies of each chunk
        self.extra = 0  # copies beyond the first, now
        self.peak_used_slots = 0
        self.peak_extra = 0

    def observe(self) -> None:
        """Account the events since the last call; update the peaks."""
        copies = self.copies
        for directory in self.directories:
            for event in directory.take_events():
                for key in event.keys:
                    held = copies[key]
                    if event.kind is EventKind.STORED:
                        self.extra += held > 0
                        copies[key] = held + 1
                    elif held > 1:
                        self.extra -= 1
                        copies[key] = held - 1
                    elif held == 1:
                        del copies[key]
        used = sum(directory.used_slots for directory in self.directories)
        self.peak_used_slots = max(self.peak_used_slots, used)
        self.peak_extra = max(self.peak_extra, self.extra)

    @property
    def distinct(self) -> int:
        """Distinct chunks held readable now."""
        return len(self.copies)


if TYPE_CHECKING:
    _conforms: type[HostDirectory] = SharedHost
