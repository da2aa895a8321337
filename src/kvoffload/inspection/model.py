"""The report of an inspection and the tally of one namespace.

A *share* is one rank's part of a chunk: one used slot of a rank's slab file (disk)
or one value (Redis). For Redis a chunk is *complete* when every rank
``0 .. world_size - 1`` has a share; the world size is given (``--world-size``) or
taken as the highest rank seen plus one. On disk a chunk is complete when every rank
holds it in the same slot (:mod:`.disk_scan`, as start-up recovery decides). The
checks of one share are in :mod:`.checks`. Plain data and accumulators; nothing here
does I/O.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvoffload.core.keys import ChunkKey
from kvoffload.inspection.checks import header_fields
from kvoffload.inspection.groups import GroupTally

EXAMPLES = 5
"""How many bad shares (and stray names) a report lists, the first by name."""

UNKNOWN_VERSION = "?"
"""The format version of a share whose header is unreadable, short or lacks the magic."""

MAX_RANK = 4095
"""Names with a higher rank are not taken for shares (no engine runs that many ranks)."""


def is_digest_hex(text: str) -> bool:
    """Whether ``text`` is a 16-byte digest or key as kvoffload names it: 32 lowercase
    hex digits."""
    return len(text) == 32 and all(c in "0123456789abcdef" for c in text)


class FirstNames:
    """The first ``limit`` names in sorted order among all offered (bounded memory,
    independent of the order they are offered in), with the total count. ``order``
    sorts before the name (disk slots: ``(rank, slot)``, so slot 2 comes before 10)."""

    def __init__(self, limit: int = EXAMPLES) -> None:
        self.limit = limit
        self.count = 0
        self._items: list[tuple[tuple[int, ...], str, str]] = []

    def add(self, name: str, note: str = "", order: tuple[int, ...] = ()) -> None:
        self.count += 1
        self._items.append((order, name, note))
        if len(self._items) > 4 * self.limit:
            self._items = sorted(self._items)[: self.limit]

    def first(self) -> list[tuple[str, str]]:
        return [(name, note) for _, name, note in sorted(self._items)[: self.limit]]


@dataclass(frozen=True)
class BadShare:
    name: str  # "<slab path relative to the tier root> slot <n>", a slab path, or the Redis key
    reason: str  # an IntegrityReason value, "unreadable", "type" (Redis) or a slab's reason
    detail: str


@dataclass(frozen=True)
class NamespaceReport:
    """What one namespace holds. ``ok``/``bad``/``bad_examples`` are filled only when
    ``verified``; every other field always. ``chunks_per_group``: the complete chunks
    by the KV cache group their headers name (:mod:`.groups`; chunks written before
    headers named groups count as group 0). ``record``: the namespace's fields as the
    engine recorded them (:mod:`kvoffload.core.identity.namespace_record`), None when there is
    no valid record (a namespace from before records, or the record was lost)."""

    namespace: str
    world_size: int
    complete_chunks: int
    incomplete_chunks: int
    chunks_per_group: dict[int, int]
    shares_per_rank: dict[int, int]
    bytes: int
    format_versions: dict[str, int]
    payload_bytes: dict[int, int]
    vanished: int
    verified: bool
    ok: int
    bad: dict[str, int]
    bad_examples: list[BadShare]
    record: dict[str, str] | None = field(default=None, kw_only=True)

    @property
    def shares(self) -> int:
        return sum(self.shares_per_rank.values())

    @property
    def bad_total(self) -> int:
        return sum(self.bad.values())


@dataclass(frozen=True)
class BadSlab:
    name: str  # path relative to the tier root
    rank: int
    reason: str  # "superblock", "foreign", "short" or "unreadable"
    detail: str


@dataclass(frozen=True)
class DiskNamespaceReport(NamespaceReport):
    """One namespace of a disk tier. A share is a used slot: ``shares_per_rank`` has
    the used slots of each rank's slab, ``slots_per_rank`` its capacity, ``bytes``
    the used slots' size and ``capacity_bytes`` all slots' size (both counting whole
    slots: header block and padded payload); ``payload_bytes`` is the payload size in
    the slabs' superblocks (size -> slab files); ``vanished`` counts slab files gone
    before they could be opened. ``duplicate_slots`` are complete slots holding a
    chunk that another complete slot holds too (start-up recovery keeps the newest).
    ``bad_slabs`` lists every slab file that could not be read as a slab of its name
    (not scanned: its rank is not in ``slots_per_rank``) or is shorter than its
    superblock says (scanned as far as it goes), whether verified or not; with
    ``verified`` they count in :attr:`bad_total`."""

    slots_per_rank: dict[int, int]
    capacity_bytes: int
    duplicate_slots: int
    bad_slabs: list[BadSlab]

    @property
    def bad_slots(self) -> int:
        return sum(self.bad.values())

    @property
    def bad_total(self) -> int:
        return self.bad_slots + (len(self.bad_slabs) if self.verified else 0)


@dataclass
class Report:
    """The whole inspection: one entry per namespace (sorted by digest), names under
    kvoffload's prefix that are not shares (``stray``), the Redis server's memory
    settings (``server``, None for disk) and warnings for the reader."""

    tier: str
    location: str
    verified: bool
    namespaces: list[NamespaceReport]
    stray: int = 0
    stray_examples: list[str] = field(default_factory=list)
    server: dict[str, str | int] | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def bad_total(self) -> int:
        return sum(ns.bad_total for ns in self.namespaces)


class NamespaceTally:
    """Accumulates one Redis namespace while a scan walks it; :meth:`report`
    summarizes. (The disk scan tallies slot by slot itself: :mod:`.disk_scan`.)

    Each share is offered once through :meth:`add` (a repeated ``(key, rank)``, as
    Redis SCAN may return, is refused by :meth:`seen`).
    """

    def __init__(self, digest_hex: str, verify: bool) -> None:
        self.digest_hex = digest_hex
        self.verify = verify
        self._ranks: dict[bytes, int] = {}  # chunk key -> bit mask of the ranks seen
        self._per_rank: Counter[int] = Counter()
        self._versions: Counter[str] = Counter()
        self._lengths: Counter[int] = Counter()
        self._bad: Counter[str] = Counter()
        self._bad_names = FirstNames()
        self._groups = GroupTally()
        self._bytes = self._ok = self._vanished = 0

    def seen(self, key: ChunkKey, rank: int) -> bool:
        return bool(self._ranks.get(key, 0) >> rank & 1)

    def add(
        self,
        key: ChunkKey,
        rank: int,
        name: str,
        *,
        size: int,
        header: bytes | memoryview | None,
        failure: tuple[str, str] | None,
    ) -> None:
        """One share: its stored ``size``, its first bytes (``header``, None when
        unreadable) and, when verifying, its failure ``(reason, detail)`` or None."""
        self._ranks[key] = self._ranks.get(key, 0) | 1 << rank
        self._per_rank[rank] += 1
        self._bytes += size
        fields = header_fields(header) if header is not None else None
        if header is None or fields is None:
            self._versions[UNKNOWN_VERSION] += 1
        else:
            self._versions[str(fields[0])] += 1
            self._lengths[fields[1]] += 1
            self._groups.note(key, header)
        if not self.verify:
            return
        if failure is None:
            self._ok += 1
        else:
            self._bad[failure[0]] += 1
            self._bad_names.add(name, f"{failure[0]}\0{failure[1]}")

    def add_vanished(self) -> None:
        """A share listed but gone when read (evicted, deleted by the engine)."""
        self._vanished += 1

    def report(
        self, world_size: int | None, record: dict[str, str] | None = None
    ) -> NamespaceReport:
        """The summary, with the namespace's ``record`` (None: none found)."""
        ranks = world_size or max(self._per_rank, default=-1) + 1
        full = (1 << ranks) - 1
        complete = [key for key, mask in self._ranks.items() if mask & full == full]
        return NamespaceReport(
            namespace=self.digest_hex,
            world_size=ranks,
            complete_chunks=len(complete),
            incomplete_chunks=len(self._ranks) - len(complete),
            chunks_per_group=self._groups.per_group(complete),
            shares_per_rank=dict(sorted(self._per_rank.items())),
            bytes=self._bytes,
            format_versions=dict(sorted(self._versions.items())),
            payload_bytes=dict(sorted(self._lengths.items())),
            vanished=self._vanished,
            verified=self.verify,
            ok=self._ok,
            bad=dict(sorted(self._bad.items())),
            bad_examples=[
                BadShare(name, *note.split("\0", 1)) for name, note in self._bad_names.first()
            ],
            record=record,
        )
