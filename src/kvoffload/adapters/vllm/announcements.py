"""What kvoffload tells KV-aware routers, for one engine: vLLM KV events for every tier
(issue 34, decision 0022).

:class:`Announcements` is built by the scheduler half when vLLM's KV events are on,
and owns the parts:

- the :class:`~.events.EventTranslator` (kvoffload's cache events as vLLM's, from the
  records of the chunks the engine planned);
- the :class:`~.event_sink.EventSink` (the engine's own publisher, reached from a
  thread; or the next step);
- the :class:`~.share_announcer.ShareAnnouncer`, when a tier is in a node share
  (every engine on it announces what it holds) or a persistent tier recovered chunks
  (its thread also repeats the first announcements for routers that subscribe late);
- the persistent tiers' record logs (``tiers/record_log.py``): records appended as
  chunks are stored there, read back at start-up, so a restart announces its warm
  chunks.

A reset of vLLM's prefix cache (``AllBlocksCleared`` makes routers forget every block
of the engine, kvoffload's tiers included) re-announces what the tiers hold after it.

Thread-safety: the scheduler half calls it under its lock; the announcer's thread
reads the private tiers' events through ``held`` (which takes that lock).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from kvoffload.adapters.vllm.block_hasher import VllmBlockHasher
from kvoffload.adapters.vllm.compat import KVCacheEvent, maybe_convert_block_hash
from kvoffload.adapters.vllm.event_sink import EventSink
from kvoffload.adapters.vllm.events import Chain, EventTranslator
from kvoffload.adapters.vllm.share_announcer import FeedReader, ShareAnnouncer
from kvoffload.core.jobs import StepPlan, TransferJob
from kvoffload.core.observe.events import CacheEvent
from kvoffload.core.scheduler_types import SchedulerConfig
from kvoffload.tiers.record_log import RecordLog


class Announcements:
    """One engine's announcements to routers (see the module docstring)."""

    def __init__(
        self,
        sc: SchedulerConfig,
        sink: EventSink,
        readers: Mapping[str, FeedReader],
        record_logs: Mapping[str, RecordLog],
        *,
        held: Callable[[], list[KVCacheEvent]],
        interval_s: float,
        hash_algo: str | None = None,
    ) -> None:
        """``readers``: each node-shared tier's feed; ``record_logs``: each private
        persistent tier's; ``held``: :meth:`held_events` under the caller's lock;
        ``hash_algo``: the engine's ``prefix_caching_hash_algo``, whose block hash
        records read back must verify with (``share_records.py``; None: none does)."""
        self.sink = sink
        self.record_logs = dict(record_logs)
        self.translator = EventTranslator(
            sc.hash_tokens, sc.hashes_per_chunk, maybe_convert_block_hash, sc.kv_groups,
            shared_tiers=frozenset(readers), persistent_tiers=frozenset(record_logs),
            hasher=VllmBlockHasher(hash_algo) if hash_algo else None,
        )  # fmt: skip
        self._reannounce = False  # vLLM cleared its prefix cache: announce again
        recovered: list[KVCacheEvent] = []
        for tier, log in self.record_logs.items():
            recovered.extend(self.translator.restore(tier, log.recover()))
        self.announcer: ShareAnnouncer | None = None
        if readers or recovered:
            self.announcer = ShareAnnouncer(
                self.translator, readers, sink, held=held, interval_s=interval_s
            )
        sink.publish(recovered)  # once the publisher is up (event_sink.py)

    def note_plan(self, plan: StepPlan, state_of: Callable[[str], Any]) -> None:
        """Remember what the chunks the plan stores or promotes cover; ``state_of``:
        the scheduler half's request state by id (its key chain and vLLM request)."""
        jobs: tuple[TransferJob, ...] = (*plan.stores, *plan.promotions)
        chains: dict[str, Chain] = {}
        for job in jobs:
            request_id = job.request_id
            if request_id is None or request_id in chains:
                continue
            state = state_of(request_id)
            if state is not None:
                chains[request_id] = (state.keys.keys, state.request, state.keys.seed)
        self.translator.note_jobs(jobs, chains)

    def note_completed(self, jobs: Iterable[TransferJob]) -> None:
        self.translator.note_completed(jobs)

    def prefix_cache_cleared(self) -> None:
        """vLLM reset its prefix cache and told routers to forget every block of this
        engine (``AllBlocksCleared``, published at the next step): what kvoffload's
        tiers still hold is announced again after it."""
        self._reannounce = True
        if self.announcer is not None:
            self.announcer.reannounce()

    def held_events(self) -> list[KVCacheEvent]:
        """A ``BlockStored`` for every chunk the private tiers hold."""
        return self.translator.held_events()

    def take(self, events: Iterable[CacheEvent]) -> list[KVCacheEvent]:
        """This step's vLLM events: ``events`` translated, re-announcements, and what
        waited for a step; records handed to the shares and the record logs."""
        out = self.translator.translate(events)
        if self._reannounce:
            self._reannounce = False
            out.extend(self.translator.held_events())
        if self.announcer is not None:
            self.announcer.queue_records(self.translator.take_outbox())
        self._persist()
        out.extend(self.sink.take())
        return out

    def _persist(self) -> None:
        """Append the records of chunks stored into persistent tiers to their logs
        (compacted from the live records once they grew several times larger)."""
        persist, self.translator.persist = self.translator.persist, {}
        for tier, entries in persist.items():
            log = self.record_logs[tier]
            log.append(entries)
            if log.needs_compaction(functools.partial(self.translator.held_count, tier)):
                log.rewrite(self.translator.held_records(tier))

    def close(self) -> None:
        if self.announcer is not None:
            self.announcer.close()
            self.announcer = None
