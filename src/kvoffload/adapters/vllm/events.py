"""kvoffload's cache events as vLLM KV events, so KV-aware routers see every tier.

The scheduler half emits :class:`~kvoffload.core.events.CacheEvent` s by chunk key
and tier. Routers know blocks by vLLM's block hashes, so :class:`EventTranslator`
remembers, for every chunk it saw planned (stored to host memory or promoted from a
lower tier), the engine block hashes it covers, the hash before it and its token ids,
and publishes:

- ``BlockStored`` (one per chunk, its ``block_size`` hash blocks) when a chunk
  becomes readable in a tier;
- ``BlockRemoved`` (the same hashes) when it leaves one.

Tiers map to vLLM's media: host -> ``CPU``; disk and Redis -> ``STORAGE``, with
``locality`` ``LOCAL`` (disk) or ``REMOTE`` (Redis, shared with other instances) and
``ownership`` naming the kvoffload tier. A chunk's record is dropped once it has
left host memory and disk; Redis evicts silently, so Redis never sends removals and
does not keep records alive. A chunk stored by another instance and never planned
here has no record; its events are skipped (counted in ``unknown``).

Hybrid models (several KV cache groups): a chunk is one group's, and its events
carry vLLM's ``group_idx`` and the group's kind (``full_attention`` or
``sliding_window`` with its window), as vLLM's own events do.

Memory: one record per chunk held in host memory or on disk (its hashes and token
ids as compact arrays). Only built when vLLM's KV events are enabled.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvoffload.adapters.vllm.compat import BlockRemoved, BlockStored, KVCacheEvent
from kvoffload.core.events import CacheEvent, EventKind
from kvoffload.core.jobs import TransferJob
from kvoffload.core.keys import ChunkKey
from kvoffload.core.kv_groups import ONE_GROUP, KVGroups

MEDIUM = {"host": "CPU", "disk": "STORAGE", "redis": "STORAGE"}
LOCALITY = {"host": "LOCAL", "disk": "LOCAL", "redis": "REMOTE"}
TRACKED_TIERS = frozenset({"host", "disk"})


@dataclass
class _Chunk:
    hashes: tuple[bytes, ...]
    parent: bytes | None
    tokens: array[int]
    group: int = 0
    held: set[str] = field(default_factory=set)


class EventTranslator:
    """Owned by the scheduler side; not thread-safe (the caller serializes)."""

    def __init__(
        self,
        hash_block_size: int,
        hashes_per_chunk: int,
        convert: Callable[[Any], Any],
        groups: KVGroups = ONE_GROUP,
    ) -> None:
        self.groups = groups
        self.hash_block_size = hash_block_size
        self.hashes_per_chunk = hashes_per_chunk
        self._convert = convert  # vLLM's maybe_convert_block_hash
        self._chunks: dict[ChunkKey, _Chunk] = {}
        self._settled: list[ChunkKey] = []  # keys of completed jobs, checked after events
        self.unknown = 0

    def __len__(self) -> int:
        return len(self._chunks)

    def note_jobs(
        self, jobs: Iterable[TransferJob], chains: dict[str, tuple[list[ChunkKey], object]]
    ) -> None:
        """Remember what the chunks of ``jobs`` cover. ``chains`` maps a request id to
        its chunk keys and its vLLM request (``block_hashes``, ``all_token_ids``)."""
        for job in jobs:
            chain = None if job.request_id is None else chains.get(job.request_id)
            if chain is None:
                continue
            keys, request = chain
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
                )

    def note_completed(self, jobs: Iterable[TransferJob]) -> None:
        """Jobs completed (successfully or not). Their chunks' records are dropped at
        the next :meth:`translate` unless an event made them held somewhere (a failed
        store must not leave a record behind)."""
        for job in jobs:
            self._settled.extend(job.keys)

    def translate(self, events: Iterable[CacheEvent]) -> list[KVCacheEvent]:
        out: list[KVCacheEvent] = []
        convert = self._convert
        for event in events:
            tier = event.tier
            for key in event.keys:
                chunk = self._chunks.get(key)
                if chunk is None:
                    self.unknown += 1
                    continue
                hashes = [convert(h) for h in chunk.hashes]
                if event.kind is EventKind.STORED:
                    if tier in TRACKED_TIERS:
                        chunk.held.add(tier)
                    out.append(
                        BlockStored(
                            block_hashes=hashes,
                            parent_block_hash=(
                                None if chunk.parent is None else convert(chunk.parent)
                            ),
                            token_ids=chunk.tokens.tolist(),
                            block_size=self.hash_block_size,
                            lora_id=None,
                            medium=MEDIUM.get(tier, "STORAGE"),
                            lora_name=None,
                            locality=LOCALITY.get(tier),
                            ownership=f"kvoffload:{tier}",
                            **self._group_fields(chunk.group, stored=True),
                        )
                    )
                else:
                    chunk.held.discard(tier)
                    out.append(
                        BlockRemoved(
                            block_hashes=hashes,
                            medium=MEDIUM.get(tier, "STORAGE"),
                            locality=LOCALITY.get(tier),
                            ownership=f"kvoffload:{tier}",
                            **self._group_fields(chunk.group, stored=False),
                        )
                    )
                    if not chunk.held:
                        del self._chunks[key]
        for key in self._settled:
            chunk = self._chunks.get(key)
            if chunk is not None and not chunk.held:
                del self._chunks[key]
        self._settled.clear()
        return out

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
