"""The tally of one namespace and the integrity checks of stored shares.

A *share* is one rank's part of a chunk: one used slot of a rank's slab file (disk)
or one value (Redis). For Redis a chunk is *complete* when every rank
``0 .. world_size - 1`` has a share; the world size is given (``--world-size``) or
taken as the highest rank seen plus one. On disk a chunk is complete when every rank
holds it in the same slot (:mod:`.disk_scan`, as start-up recovery decides).

:func:`check_stored` verifies a Redis value without knowing the engine's payload size:
the payload length is read from the header, and the value must be exactly that long.
:func:`check_slot` verifies a disk slot as :meth:`kvoffload.tiers.disk.DiskStore.read_into`
does, against the payload size in the slab's superblock. Pure functions and plain
accumulators; nothing here does I/O.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from kvoffload.core.chunk_format import (
    HEADER_BYTES,
    MAGIC,
    IntegrityError,
    IntegrityReason,
    check_header,
    check_payload,
)
from kvoffload.core.keys import ChunkKey, shard_key
from kvoffload.tiers.disk import KEY_OFFSET, PAYLOAD_OFFSET, parse_header_block

EXAMPLES = 5
"""How many bad shares (and stray names) a report lists, the first by name."""

SLOT_HEAD_BYTES = KEY_OFFSET + 24
"""What a slot's header block holds: the chunk header, the chunk key and the write
sequence number (what :meth:`~kvoffload.tiers.disk.DiskStore.clear` zeroes)."""

UNKNOWN_VERSION = "?"
"""The format version of a share whose header is unreadable, short or lacks the magic."""

MAX_RANK = 4095
"""Names with a higher rank are not taken for shares (no engine runs that many ranks)."""


def is_digest_hex(text: str) -> bool:
    """Whether ``text`` is a 16-byte digest or key as kvoffload names it: 32 lowercase
    hex digits."""
    return len(text) == 32 and all(c in "0123456789abcdef" for c in text)


def header_fields(header: bytes | memoryview) -> tuple[int, int] | None:
    """``(format version, payload length)`` of a header that starts with the magic;
    None for anything else (too short, another magic)."""
    view = memoryview(header)
    if len(view) < HEADER_BYTES or bytes(view[:4]) != MAGIC:
        return None
    return int.from_bytes(view[4:6], "little"), int.from_bytes(view[8:16], "little")


def check_stored(
    stored: bytes | memoryview, namespace_digest: bytes, key: ChunkKey, rank: int
) -> IntegrityError | None:
    """None when ``stored`` (one whole Redis value: header and payload) is what
    kvoffload writes for ``rank``'s share of ``key`` in the namespace
    ``namespace_digest``; otherwise the :class:`IntegrityError` naming the first
    failed check.

    Checks, in the order of the engine's readers: size of the header, magic, format
    version, namespace digest, storage key (``shard_key(key, rank)``); then, with the
    payload length ``L`` the header gives, that ``stored`` is exactly header + ``L``
    bytes; then the xxh3 checksum.
    """
    view = memoryview(stored)
    fields = header_fields(view)
    length = fields[1] if fields is not None else 0
    try:
        expected = check_header(view[:HEADER_BYTES], namespace_digest, shard_key(key, rank), length)
        end = HEADER_BYTES + length
        if len(view) > end:
            raise IntegrityError(IntegrityReason.SIZE, f"{len(view)} bytes, at most {end} expected")
        check_payload(view[HEADER_BYTES:end], length, expected)
    except IntegrityError as exc:
        return exc
    return None


def slot_key(head: bytes | memoryview) -> ChunkKey:
    """The chunk key a slot's header block names (after the chunk header); a block
    cut short reads as zero-padded, as the disk tier's reader sees it."""
    block = bytes(head[:SLOT_HEAD_BYTES])
    return parse_header_block(block.ljust(SLOT_HEAD_BYTES, b"\0"))[0]


def check_slot_header(
    head: bytes | memoryview, namespace_digest: bytes, rank: int, payload_bytes: int
) -> IntegrityError | None:
    """None when the header block ``head`` (at least the chunk header and the key
    after it) is a valid header for ``rank``'s share of the chunk it names, in a slab
    of ``payload_bytes`` payloads: the check start-up recovery makes before adopting a
    slot (:func:`kvoffload.tiers.disk_index.scan_slab`)."""
    storage_key = shard_key(slot_key(head), rank)
    try:
        check_header(memoryview(head)[:HEADER_BYTES], namespace_digest, storage_key, payload_bytes)
    except IntegrityError as exc:
        return exc
    return None


def check_slot(
    slot: bytes | memoryview, namespace_digest: bytes, rank: int, payload_bytes: int
) -> IntegrityError | None:
    """None when ``slot`` (a whole slot as read from a slab, possibly cut short by
    the end of the file) holds a chunk the disk tier's reader accepts; otherwise the
    :class:`IntegrityError` it would raise.

    The checks of :meth:`kvoffload.tiers.disk.DiskStore.read_into`, the expected
    chunk key being the one after the header: the chunk header (size, magic, version,
    namespace digest, storage key ``shard_key(key, rank)``, payload length
    ``payload_bytes`` from the slab's superblock), then the payload at
    ``PAYLOAD_OFFSET`` (all there: ``size``; checksum). The padding after the payload
    is not checked (neither does the reader).
    """
    view = memoryview(slot)
    storage_key = shard_key(slot_key(view), rank)
    try:
        expected = check_header(view[:HEADER_BYTES], namespace_digest, storage_key, payload_bytes)
        check_payload(
            view[PAYLOAD_OFFSET : PAYLOAD_OFFSET + payload_bytes], payload_bytes, expected
        )
    except IntegrityError as exc:
        return exc
    return None


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
    ``verified``; every other field always."""

    namespace: str
    world_size: int
    complete_chunks: int
    incomplete_chunks: int
    shares_per_rank: dict[int, int]
    bytes: int
    format_versions: dict[str, int]
    payload_bytes: dict[int, int]
    vanished: int
    verified: bool
    ok: int
    bad: dict[str, int]
    bad_examples: list[BadShare]

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
        if fields is None:
            self._versions[UNKNOWN_VERSION] += 1
        else:
            self._versions[str(fields[0])] += 1
            self._lengths[fields[1]] += 1
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

    def report(self, world_size: int | None) -> NamespaceReport:
        ranks = world_size or max(self._per_rank, default=-1) + 1
        full = (1 << ranks) - 1
        complete = sum(1 for mask in self._ranks.values() if mask & full == full)
        return NamespaceReport(
            namespace=self.digest_hex,
            world_size=ranks,
            complete_chunks=complete,
            incomplete_chunks=len(self._ranks) - complete,
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
        )
