"""The host tier's directory as its users see it: :class:`HostDirectory`.

Three classes implement it: the engine's own :class:`~kvoffload.core.directory.Directory`,
the client of a directory that a node process keeps for every engine of a node
(:class:`~kvoffload.share.client.ShareDirectory`) and the simulator's directory shared
by its replicas (:class:`~kvoffload.simulate.host_ledger.SharedHost`). Each module
checks statically that its class conforms; one contract suite
(``tests/contract/test_directory_contract.py``) runs over all three.

Its users: the scheduler half (``core/scheduler/``), the tier planner and a lower tier
booked in a directory (``core/tiering/``), the tier builds (``tiers/``), the metrics
view and the simulator. They hold a ``HostDirectory`` and never ask which one it is.

Failure contract, common to all: a caller breaking a precondition (loading a chunk
that is not a hit, completing what was not prepared) gets
:class:`~kvoffload.core.errors.ContractViolation` and nothing changes. Transfer
failures are not exceptions: they arrive as ``complete_store(..., success=False)``.
A directory kept by another process may not answer a call: its queries then answer
as an empty, full directory (a miss, 0, FREE, None), ``prepare_store`` answers
``no_room``, ``try_prepare_load`` None, and ``touch``, ``record_lookups`` and
``discard`` do nothing; the calls whose contract has no miss (``prepare_load``,
``slots_of``, ``groups_of``) raise :class:`~kvoffload.core.errors.DirectoryUnavailable`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from kvoffload.core.chunk_state import ChunkState
from kvoffload.core.directory.results import LookupResult, PreparedStore
from kvoffload.core.keys import ChunkKey
from kvoffload.core.observe.events import CacheEvent
from kvoffload.core.observe.recorder import CounterScope

__all__ = ["EvictionHook", "HostDirectory"]

EvictionHook = Callable[[tuple[ChunkKey, ...]], None]
"""Told the chunks one eviction took, after they left the directory (``on_evict``);
it must not call back into the directory."""


class HostDirectory(Protocol):
    """Where each chunk of one tier lives, its pins and its two-phase bookings.

    ``tier``: the tier's label (events, metrics, errors). ``metrics``: where it counts
    ``evictions_total``, ``admission_refusals_total`` and ``no_room_total`` under its
    tier label; its owner may rebind it onto its own recorder, or declare and count
    more there. ``on_evict``: set by its owner (the tier planner), called with each
    eviction its stores caused.
    """

    on_evict: EvictionHook | None

    @property
    def tier(self) -> str: ...

    @property
    def metrics(self) -> CounterScope: ...

    # ------------------------------------------------------------ queries (no side effects)

    @property
    def num_slots(self) -> int:
        """Capacity in chunks."""

    @property
    def free_slots(self) -> int:
        """Slots holding nothing."""

    @property
    def used_slots(self) -> int:
        """Slots in use (STORING, READY, PINNED, discarded ones in flight included)."""

    @property
    def evictable_count(self) -> int:
        """Chunks a store may evict now (READY, unpinned)."""

    @property
    def storing_count(self) -> int:
        """Slots being stored (live or discarded) by this user's stores."""

    @property
    def pinned_count(self) -> int:
        """Pins this user holds (on readable and discarded chunks)."""

    def __len__(self) -> int:
        """Chunks present (STORING, READY or PINNED), discarded ones excluded."""

    def lookup(self, keys: Sequence[ChunkKey]) -> LookupResult:
        """Per-key status and the length of the leading readable run."""

    def readable_prefix(self, keys: Sequence[ChunkKey]) -> int:
        """Number of leading keys that are readable now (advisory where other users
        share the directory: ``try_prepare_load`` confirms it)."""

    def state_of(self, key: ChunkKey) -> ChunkState:
        """State of ``key``'s slot; FREE when the key is not present."""

    def pins_of(self, key: ChunkKey) -> int:
        """Pins held on ``key`` (by every user); 0 when not present."""

    def slot_of(self, key: ChunkKey) -> int | None:
        """The slot holding ``key`` (any state but FREE), or None."""

    def slots_of(self, keys: Sequence[ChunkKey]) -> tuple[int, ...]:
        """The slots of present ``keys``, in order; a key not present is a
        ``ContractViolation``."""

    def groups_of(self, slots: Sequence[int]) -> tuple[int, ...]:
        """The KV cache group of the chunk in each of ``slots`` (allocated slots)."""

    # ------------------------------------------------------------ recency and admission

    def touch(self, keys: Sequence[ChunkKey]) -> None:
        """Mark readable ``keys`` as used, ``keys[0]`` most recent (a prefix's head
        outlives its tail). Absent keys are ignored."""

    def record_lookups(self, keys: Iterable[ChunkKey]) -> None:
        """Count one request's interest in ``keys`` toward admission; present keys
        are not counted."""

    # ------------------------------------------------------------ loads

    def prepare_load(self, keys: Sequence[ChunkKey]) -> tuple[int, ...]:
        """Pin every key (each must be a HIT, else ``ContractViolation``, nothing
        pinned) and return their slots, in order. A pinned chunk is never evicted."""

    def try_prepare_load(self, keys: Sequence[ChunkKey]) -> tuple[int, ...] | None:
        """As :meth:`prepare_load`, or None (nothing pinned) when a key is not a hit
        (any more: another user may have evicted it) or the directory did not answer."""

    def complete_load(self, keys: Sequence[ChunkKey]) -> None:
        """Drop one pin per key, taken by a load prepared earlier. A chunk discarded
        while pinned is freed when its last pin goes."""

    # ------------------------------------------------------------ stores

    def prepare_store(
        self,
        keys: Sequence[ChunkKey],
        *,
        admit_all: bool = False,
        groups: Sequence[int] | None = None,
    ) -> PreparedStore:
        """Allocate STORING slots (never evicted, never readable) for the keys that
        are new and admitted; ``groups``: one KV cache group per key (None: all 0).
        Skips present keys, keys whose discarded copy is in flight and duplicates;
        refuses keys below the admission threshold unless ``admit_all``. Evicts
        atomically: without room for every new key nothing changes and the result
        says ``no_room``; evictions are counted, reported as a REMOVED event and to
        ``on_evict``."""

    def complete_store(self, keys: Sequence[ChunkKey], success: bool) -> None:
        """Finish stores prepared earlier: READY on success (a STORED event), freed
        on failure. A store of a chunk discarded meanwhile frees its slot either way."""

    # ------------------------------------------------------------ removal and events

    def discard(self, keys: Iterable[ChunkKey]) -> list[ChunkKey]:
        """Make ``keys`` miss from now on. READY chunks are freed at once; pinned or
        storing chunks leave the index now and free their slot when their job
        completes. Returns the keys that were readable (a REMOVED event names them)."""

    def reset(self) -> list[ChunkKey]:
        """Discard every chunk (a shared directory: every chunk of this user's
        namespace) and forget admission counters; slots of jobs in flight are freed
        when they complete. Returns the keys that were readable."""

    def take_events(self) -> list[CacheEvent]:
        """The STORED and REMOVED events of this user's calls since the last call,
        oldest first."""

    def check_integrity(self) -> None:
        """Verify every invariant; ``ContractViolation`` naming the first broken one.
        For tests and debug runs."""
