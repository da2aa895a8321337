"""kvoffload's cache events as vLLM KV events, so KV-aware routers see every tier.

The scheduler half emits :class:`~kvoffload.core.observe.events.CacheEvent` s by chunk key
and tier. Routers know blocks by vLLM's block hashes, so :class:`EventTranslator`
remembers, for every chunk it saw planned (stored to host memory or promoted from a
lower tier), the engine block hashes it covers, the hash before it and its token ids,
and publishes:

- ``BlockStored`` (one per chunk, its ``block_size`` hash blocks) when a chunk
  becomes readable in a tier;
- ``BlockRemoved`` (the same hashes) when it leaves one.

Tiers map to vLLM's media: host -> ``CPU``; disk and Redis -> ``STORAGE``, with
``locality`` ``LOCAL`` (disk) or ``REMOTE`` (Redis, shared with other instances).
``ownership`` is None for a LOCAL tier, as on the events of vLLM's own CPU offloading:
routers credit an instance's host memory and disk by medium, and Dynamo's indexer
(1.6.1) credits no event that carries an ownership at all. A REMOTE tier's events name
it (``kvoffload:redis``): no router credits a shared store to one instance (Dynamo drops
REMOTE events whatever they carry), and a consumer that does tells kvoffload's store
from another's by it. A chunk's record is dropped once it has
left host memory and disk; Redis evicts silently, so Redis never sends removals and
does not keep records alive. A chunk stored by another instance and never planned
here has no record; its events are skipped (counted in ``unknown``).

Request identity beyond tokens: each record also keeps what vLLM's own block-pool
events carry about the request the chunk was computed for: the LoRA adapter's id and
name, the session id, and each hash block's extra keys (the LoRA name, multimodal
``(identifier, offset)`` pairs, the cache salt of the first block, prompt-embedding
digests), computed by vLLM's own ``generate_block_hash_extra_keys`` over the request
as its block hasher computed the hashes, kept as the hasher took them (so a record can
be checked against its hashes, ``share_records.py``) and published in the untagged
form vLLM publishes (``to_event_extra_keys``). A consumer that rebuilds hashes from
events files LoRA, multimodal and salted chunks as it files vLLM's own.

Records read back (a persistent tier's record log at start-up, here; a node share's
feed, ``share_announcer.py``) are checked in full with the engine's block hasher
(``hasher``, ``block_hasher.py``): one that does not describe its chunk as this engine
hashes it is counted (``bad_records``) and never published.

Hybrid models (several KV cache groups): a chunk is one group's, and its events
carry vLLM's ``group_idx`` and the group's kind (``full_attention`` or
``sliding_window`` with its window), as vLLM's own events do.

Memory: one record per chunk held in host memory or on disk (its hashes and token
ids as compact arrays; extra keys, LoRA and session only where the request has them).
Only built when vLLM's KV events are enabled. Computing a chunk's extra keys never
raises: a request they cannot be computed for is published without them (counted in
``no_extra_keys``).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvoffload.adapters.vllm import share_records
from kvoffload.adapters.vllm.compat import (
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    generate_block_hash_extra_keys,
    get_mm_features_in_window,
    to_event_extra_keys,
)
from kvoffload.core.jobs import TransferJob
from kvoffload.core.keys import ChunkKey
from kvoffload.core.kv_groups import ONE_GROUP, KVGroups
from kvoffload.core.observe.events import CacheEvent, EventKind
from kvoffload.tiers.registry import TIERS
from kvoffload.tiers.spec import Locality

MEDIUM = {spec.name: spec.medium for spec in TIERS}
LOCALITY = {spec.name: spec.locality.value for spec in TIERS}
OWNERSHIP: dict[str, str | None] = {
    spec.name: None if spec.locality is Locality.LOCAL else f"kvoffload:{spec.name}"
    for spec in TIERS
}
"""Each tier's ``ownership`` in vLLM's events (see the module docstring): None for a
LOCAL tier, ``kvoffload:<tier>`` for a REMOTE one."""
TRACKED_TIERS = frozenset(spec.name for spec in TIERS if spec.announces_removals)
"""The tiers whose chunks are tracked until removed: those that announce removals."""


ExtraKeys = tuple[tuple[Any, ...] | None, ...]
"""One entry per hash block, as vLLM's block hasher takes them (tagged); published
through :func:`event_keys`."""
Chain = tuple[list[ChunkKey], object, ChunkKey]
"""A request's chunk keys, its vLLM request and the key before its first chunk."""


@dataclass(slots=True)
class _Chunk:
    hashes: tuple[bytes, ...]
    parent: bytes | None
    tokens: array[int]
    group: int = 0
    parent_key: bytes = b""  # the chain key before this chunk's (share records)
    held: set[str] = field(default_factory=set)
    block_keys: ExtraKeys | None = None  # as hashed; None: no block has any
    lora: tuple[int, str] | None = None  # the adapter's id and name
    session_id: str | None = None


def request_block_keys(request: Any, first_block: int, count: int, size: int) -> ExtraKeys | None:
    """The extra keys of ``count`` hash blocks of ``size`` tokens of ``request``, from
    block ``first_block`` on, as vLLM's block hasher computes and hashes them (vLLM's
    functions, its multimodal window search included); None when no block has any.
    Raises what vLLM's functions raise for an object that is no request."""
    start = first_block * size
    mm_index = 0
    features = request.mm_features
    if start > 0 and features:
        last = features[-1].mm_position
        if last.offset + last.length > start:
            mm_index, _ = get_mm_features_in_window(features, start, start + size)
    keys: list[tuple[Any, ...] | None] = []
    for block in range(count):
        low = start + block * size
        extra, mm_index = generate_block_hash_extra_keys(request, low, low + size, mm_index)
        keys.append(extra)
    if all(k is None for k in keys):
        return None
    return tuple(keys)


def event_keys(keys: ExtraKeys | None) -> list[tuple[Any, ...] | None] | None:
    """Blocks' extra keys as hashed, in the form vLLM's events publish them."""
    return None if keys is None else to_event_extra_keys(keys)


class EventTranslator:
    """Owned by the scheduler side; not thread-safe (the caller serializes)."""

    def __init__(
        self,
        hash_block_size: int,
        hashes_per_chunk: int,
        convert: Callable[[Any], Any],
        groups: KVGroups = ONE_GROUP,
        *,
        shared_tiers: frozenset[str] = frozenset(),
        persistent_tiers: frozenset[str] = frozenset(),
        hasher: share_records.RecordHasher | None = None,
    ) -> None:
        self.groups = groups
        # The engine's block hasher: what records read back are checked with, and
        # the root the records made here name (None: records read back never
        # verify, records made here name no root).
        self.hasher = hasher
        # Tiers kept in a node share: their chunks are announced by every engine
        # attached to it from the share's feed (share_announcer.py), not here; a chunk
        # this engine stored there goes to ``outbox`` as a record for the share.
        self.shared_tiers = shared_tiers
        self.outbox: dict[str, list[tuple[ChunkKey, bytes]]] = {}
        # Private tiers that outlive the engine (disk): their chunks' records also go
        # to ``persist`` (the tier's record log), so that a restart can announce them.
        self.persistent_tiers = persistent_tiers - shared_tiers
        self.persist: dict[str, list[tuple[ChunkKey, bytes]]] = {}
        self.hash_block_size = hash_block_size
        self.hashes_per_chunk = hashes_per_chunk
        self._convert = convert  # vLLM's maybe_convert_block_hash
        self._chunks: dict[ChunkKey, _Chunk] = {}
        self._settled: list[ChunkKey] = []  # keys of completed jobs, checked after events
        self.unknown = 0
        self.no_extra_keys = 0  # chunks whose request's extra keys could not be computed
        self.bad_records = 0  # recovered records that did not verify for this engine

    def __len__(self) -> int:
        return len(self._chunks)

    def note_jobs(self, jobs: Iterable[TransferJob], chains: dict[str, Chain]) -> None:
        """Remember what the chunks of ``jobs`` cover. ``chains`` maps a request id to
        its chunk keys, its vLLM request (``block_hashes``, ``all_token_ids``, and
        what vLLM's events say of it: LoRA, session, extra keys) and the key before
        its first chunk."""
        for job in jobs:
            chain = None if job.request_id is None else chains.get(job.request_id)
            if chain is None:
                continue
            keys, request, seed = chain
            index = {
                self.groups.key(k, g): (i, g)
                for i, k in enumerate(keys)
                for g in range(len(self.groups))
            }
            hashes: Sequence[bytes] = getattr(request, "block_hashes", ())
            tokens: Sequence[int] = getattr(request, "all_token_ids", ())
            n, size = self.hashes_per_chunk, self.hash_block_size
            for key in job.keys:
                i, group = index.get(key, (-1, 0))
                if i < 0 or key in self._chunks or len(hashes) < (i + 1) * n:
                    continue
                self._chunks[key] = _Chunk(
                    tuple(hashes[i * n : (i + 1) * n]),
                    hashes[i * n - 1] if i else None,
                    array("q", tokens[i * n * size : (i + 1) * n * size]),
                    group,
                    block_keys=self._block_keys(request, i * n, n, size),
                    lora=_lora(request),
                    session_id=getattr(request, "session_id", None),
                    parent_key=keys[i - 1] if i else seed,
                )

    def note_completed(self, jobs: Iterable[TransferJob]) -> None:
        """Jobs completed (successfully or not). Their chunks' records are dropped at
        the next :meth:`translate` unless an event made them held somewhere (a failed
        store must not leave a record behind)."""
        for job in jobs:
            self._settled.extend(job.keys)

    def translate(self, events: Iterable[CacheEvent]) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        for event in events:
            tier = event.tier
            for key in event.keys:
                chunk = self._chunks.get(key)
                if chunk is None:
                    self.unknown += 1
                    continue
                if tier in self.shared_tiers:
                    if event.kind is EventKind.STORED:
                        self.outbox.setdefault(tier, []).append((key, self._record(chunk)))
                    continue
                if event.kind is EventKind.STORED:
                    if tier in TRACKED_TIERS:
                        chunk.held.add(tier)
                    if tier in self.persistent_tiers:
                        self.persist.setdefault(tier, []).append((key, self._record(chunk)))
                    out.append(self._stored(chunk, tier))
                else:
                    chunk.held.discard(tier)
                    out.append(self.removed_event(chunk.hashes, chunk.group, tier))
                    if not chunk.held:
                        del self._chunks[key]
        for key in self._settled:
            chunk = self._chunks.get(key)
            if chunk is not None and not chunk.held:
                del self._chunks[key]
        self._settled.clear()
        return out

    def held_events(self) -> list[KVCacheEvent]:
        """A ``BlockStored`` for every chunk held in a tier this translator announces
        (a re-announcement, after vLLM's ``AllBlocksCleared``)."""
        return [
            self._stored(chunk, tier)
            for chunk in self._chunks.values()
            for tier in sorted(chunk.held)
        ]

    def restore(self, tier: str, entries: Iterable[tuple[ChunkKey, bytes]]) -> list[KVCacheEvent]:
        """Hold the chunks a persistent tier recovered at start-up, from their records
        (those that do not verify for this engine are counted in ``bad_records`` and
        left out); their ``BlockStored`` events."""
        out: list[KVCacheEvent] = []
        for key, data in entries:
            record = self.read_record(key, data)
            if record is None:
                self.bad_records += 1
                continue
            chunk = self._chunks.setdefault(key, _Chunk(
                tuple(record.hashes), record.parent_hash, array("q", record.tokens),
                record.group, record.parent_key, block_keys=record.hashed_keys(),
                lora=record.lora, session_id=record.session_id,
            ))  # fmt: skip
            chunk.held.add(tier)
            out.append(self._stored(chunk, tier))
        return out

    def read_record(self, key: ChunkKey, data: bytes) -> share_records.ChunkRecord | None:
        """The record ``data`` of chunk ``key`` if it describes that chunk as this
        engine hashes it (``share_records.decode``), else None."""
        return share_records.decode(
            data, key, self.groups, self.hashes_per_chunk, self.hash_block_size, hasher=self.hasher
        )

    def held_records(self, tier: str) -> list[tuple[ChunkKey, bytes]]:
        """The records of the chunks held in ``tier`` (a record log's compaction)."""
        return [(k, self._record(c)) for k, c in self._chunks.items() if tier in c.held]

    def held_count(self, tier: str) -> int:
        """How many chunks are held in ``tier``."""
        return sum(tier in c.held for c in self._chunks.values())

    def _stored(self, chunk: _Chunk, tier: str) -> KVCacheEvent:
        return self.stored_event(
            tier,
            hashes=chunk.hashes,
            parent=chunk.parent,
            tokens=chunk.tokens.tolist(),
            group=chunk.group,
            extra_keys=event_keys(chunk.block_keys),
            lora=chunk.lora,
            session_id=chunk.session_id,
        )

    def take_outbox(self) -> dict[str, list[tuple[ChunkKey, bytes]]]:
        """The records of chunks this engine made readable in a shared tier since the
        last call, by tier (for the share's feed)."""
        outbox, self.outbox = self.outbox, {}
        return outbox

    def stored_event(
        self,
        tier: str,
        *,
        hashes: Sequence[bytes],
        parent: bytes | None,
        tokens: list[int],
        group: int,
        extra_keys: Sequence[Any] | None,
        lora: tuple[int, str] | None,
        session_id: str | None,
    ) -> KVCacheEvent:
        """vLLM's ``BlockStored`` for one chunk readable in ``tier``."""
        convert = self._convert
        converted = [convert(h) for h in hashes]
        return BlockStored(
            block_hashes=converted,
            parent_block_hash=None if parent is None else convert(parent),
            token_ids=tokens,
            block_size=self.hash_block_size,
            lora_id=lora[0] if lora else None,
            medium=MEDIUM.get(tier, "STORAGE"),
            lora_name=lora[1] if lora else None,
            extra_keys=list(extra_keys) if extra_keys is not None else [None] * len(hashes),
            locality=LOCALITY.get(tier),
            ownership=OWNERSHIP.get(tier, f"kvoffload:{tier}"),
            session_id=session_id,
            **self._group_fields(group, stored=True),
        )

    def removed_event(self, hashes: Sequence[bytes], group: int, tier: str) -> KVCacheEvent:
        """vLLM's ``BlockRemoved`` for one chunk that left ``tier``."""
        return BlockRemoved(
            block_hashes=[self._convert(h) for h in hashes],
            medium=MEDIUM.get(tier, "STORAGE"),
            locality=LOCALITY.get(tier),
            ownership=OWNERSHIP.get(tier, f"kvoffload:{tier}"),
            **self._group_fields(group, stored=False),
        )

    def _record(self, chunk: _Chunk) -> bytes:
        root = self.hasher.root() if self.hasher is not None else None
        return share_records.encode(
            share_records.ChunkRecord(
                share_records.FORMAT, chunk.parent_key, list(chunk.hashes), chunk.parent,
                chunk.tokens.tobytes(), chunk.group,
                None if chunk.block_keys is None else list(chunk.block_keys),
                chunk.lora, chunk.session_id, root or b"",
            )
        )  # fmt: skip

    def _block_keys(self, request: object, first: int, count: int, size: int) -> ExtraKeys | None:
        try:
            return request_block_keys(request, first, count, size)
        except Exception:  # not a request vLLM's functions can read: published without
            self.no_extra_keys += 1
            return None

    def _group_fields(self, group: int, *, stored: bool) -> dict[str, Any]:
        """vLLM's per-group event fields (none for a one-group model)."""
        if self.groups.single:
            return {}
        if not stored:
            return {"group_idx": group}
        window = self.groups.groups[group].window
        kind = "full_attention" if window is None else "sliding_window"
        return {
            "group_idx": group,
            "kv_cache_spec_kind": kind,
            "kv_cache_spec_sliding_window": window,
        }


def _lora(request: object) -> tuple[int, str] | None:
    """The LoRA adapter's id and name, as vLLM's events publish them (None: none)."""
    lora = getattr(request, "lora_request", None)
    if lora is None:
        return None
    return int(lora.adapter_id), str(lora.name)
