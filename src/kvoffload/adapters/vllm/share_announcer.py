"""Every engine attached to a node share announces what the share holds (issue 34,
decision 0022).

A router credits an engine with what that engine's event stream announced. Any
engine attached to a node share (host memory or disk) can load what the share holds
of its namespace, so each one publishes, on its own vLLM event stream, a
``BlockStored`` (medium of the tier) for every chunk the share made readable, and a
``BlockRemoved`` when the share evicts or discards it, whichever engine stored it.

How: the engine that stores a chunk into a share sends the share the chunk's record
(``share_records.py``; the translator's ``outbox``); every engine's announcer follows
the share's feed (``share/feed_reader.py``), turns records into events with the
translator's event builders, and hands them to the engine's publisher
(``event_sink.py``) from a thread of its own, every ``interval_s``, so that an idle
engine announces too. An engine that attaches to a share that already holds chunks
(started later, restarted) announces them all at its first poll (the feed's
snapshot), and removes what it announced and the share no longer holds after any gap.
It publishes the whole set again a few times in its first minute
(:data:`REFRESH_AFTER_S`), for routers that subscribe to it late, with what the
engine's private tiers hold (``held``: a restart's warm disk chunks, announced from
their record log at start-up).

State: per tier, the keys announced, what their removal needs (the chunk's block
hashes and group) and a digest of the record announced: about 300 bytes per announced
chunk. A re-announcement reads every record again; one whose bytes are those already
checked for its key is not hashed again (checking a record costs vLLM's block hash
per hash block: about 10 us for a chunk of 16 blocks of 16 tokens). Owned by the announcer's
thread; :meth:`ShareAnnouncer.queue_records` and :meth:`ShareAnnouncer.reannounce` are
the only calls from another thread (the scheduler half's), through a lock.

Failures: a share that does not answer delays announcements (the next poll catches
up); a record that does not verify for this engine (another geometry, corrupt, not
the chunk's, or not what its token ids, parent hash, extra keys and LoRA hash to with
this engine's block hasher: ``share_records.py``) is skipped and counted
(``bad_records``); nothing raises into vLLM.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import xxhash

from kvoffload.adapters.vllm import share_records
from kvoffload.adapters.vllm.compat import KVCacheEvent
from kvoffload.adapters.vllm.event_sink import EventSink
from kvoffload.adapters.vllm.events import EventTranslator, event_keys
from kvoffload.core.keys import ChunkKey

logger = logging.getLogger("kvoffload")

INTERVAL_S = 0.25
REFRESH_AFTER_S = (5.0, 15.0, 45.0)
"""When, after the announcer starts, it publishes the whole set again: a router that
was waiting for this engine's publisher connects to it some time after it binds
(Dynamo's indexer, retrying a worker it was told of before the engine listened, took
1 to 2 s after the bind, measured), and ZMQ drops what is published before it does."""


class FeedPoll(Protocol):
    """What a share's feed says changed (``share.feed_reader.FeedUpdate``)."""

    stored: list[tuple[ChunkKey, bytes]]
    removed: list[ChunkKey]
    full: bool


class FeedReader(Protocol):
    """One share's feed as this engine reads it (``share.feed_reader.FeedReader``,
    opened by ``tiers.node_shares.OpenedShare.feed_reader``)."""

    def send_records(self, entries: Sequence[tuple[ChunkKey, bytes]]) -> None: ...

    def poll(self) -> FeedPoll: ...

    def forget_cursor(self) -> None: ...

    @property
    def epoch(self) -> int: ...

    def close(self) -> None: ...


class ShareAnnouncer:
    """Announces the chunks of each node-shared tier (see the module docstring)."""

    def __init__(
        self,
        translator: EventTranslator,
        readers: Mapping[str, FeedReader],
        sink: EventSink,
        *,
        held: Callable[[], list[KVCacheEvent]] | None = None,
        interval_s: float = INTERVAL_S,
        start: bool = True,
    ) -> None:
        self.translator = translator
        self.readers = dict(readers)
        self.sink = sink
        self.interval_s = interval_s
        self.held = held  # what the engine's private tiers hold (refreshes)
        # tier -> key -> (block hashes, group, record digest): what each announced
        # chunk's removal needs, and the record checked
        self.announced: dict[str, dict[ChunkKey, tuple[tuple[bytes, ...], int, int]]] = {
            tier: {} for tier in self.readers
        }
        self._checked: dict[ChunkKey, int] = {}  # during a re-announcement: as announced
        self.stats: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._outbox: dict[str, list[tuple[ChunkKey, bytes]]] = {}
        self._reannounce = False
        self._refresh_at = [time.monotonic() + s for s in REFRESH_AFTER_S]
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if start:
            self._thread = threading.Thread(
                target=self._run, name="kvoffload-share-announcer", daemon=True
            )
            self._thread.start()

    # ------------------------------------------------------------ other threads

    def queue_records(self, outbox: Mapping[str, Sequence[tuple[ChunkKey, bytes]]]) -> None:
        """Records of chunks this engine stored into a share, to send at the next
        round (which it starts at once)."""
        if not any(outbox.values()):
            return
        with self._lock:
            for tier, entries in outbox.items():
                if tier in self.readers:
                    self._outbox.setdefault(tier, []).extend(entries)
        self._wake.set()

    def reannounce(self) -> None:
        """vLLM told routers to forget every block (``AllBlocksCleared``): publish
        everything announced again, at the next step (after vLLM's event)."""
        with self._lock:
            self._reannounce = True
        self._wake.set()

    def stop_thread(self) -> None:
        """Stop the thread; rounds are then the caller's (:meth:`round`: a harness
        drives them at its step boundaries)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def close(self) -> None:
        self.stop_thread()
        for reader in self.readers.values():
            reader.close()

    # ------------------------------------------------------------ the thread

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.round()
            except Exception:  # never let the thread die: the next round retries
                self.stats["round_errors"] += 1
                logger.exception("kvoffload: a share announcement round failed")
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def round(self) -> None:
        """One round: send queued records, follow each share's feed, publish."""
        with self._lock:
            outbox, self._outbox = self._outbox, {}
            reannounce, self._reannounce = self._reannounce, False
        for tier, entries in outbox.items():
            self.readers[tier].send_records(entries)
        events: list[KVCacheEvent] = []
        if self._refresh_at and time.monotonic() >= self._refresh_at[0]:
            del self._refresh_at[0]
            events.extend(self._everything())
            if self.held is not None:
                events.extend(self.held())
            self.stats["refreshes"] += 1
        else:
            for tier, reader in self.readers.items():
                events.extend(self._follow(tier, reader))
        self.sink.publish(events)  # also what waited for the publisher
        if reannounce:
            self.sink.publish(self._everything(), defer=True)

    def _follow(self, tier: str, reader: FeedReader) -> list[KVCacheEvent]:
        update = reader.poll()
        announced = self.announced[tier]
        out: list[KVCacheEvent] = []
        t = self.translator
        if update.full:
            present = {key for key, _ in update.stored}
            gone = [key for key in announced if key not in present]
            update.removed = gone
            update.stored = [(k, r) for k, r in update.stored if k not in announced]
        for key, data in update.stored:
            if key in announced:
                continue
            digest = xxhash.xxh3_64_intdigest(data)
            if self._checked.get(key) == digest:
                record = share_records.parse(data)  # these bytes were checked for this key
            else:
                record = t.read_record(key, data)
            if record is None:
                self.stats["bad_records"] += 1
                continue
            announced[key] = (tuple(record.hashes), record.group, digest)
            self.stats["stored"] += 1
            out.append(
                t.stored_event(
                    tier,
                    hashes=record.hashes,
                    parent=record.parent_hash,
                    tokens=record.token_ids(),
                    group=record.group,
                    extra_keys=event_keys(record.hashed_keys()),
                    lora=record.lora,
                    session_id=record.session_id,
                )
            )
        for key in update.removed:
            held = announced.pop(key, None)
            if held is not None:
                out.append(t.removed_event(held[0], held[1], tier))
                self.stats["removed"] += 1
        return out

    def _everything(self) -> list[KVCacheEvent]:
        """A ``BlockStored`` for every chunk the shares hold now (a re-announcement):
        token ids are not kept after a first announcement, so the records are read
        again, from the feed's snapshot."""
        for reader in self.readers.values():
            reader.forget_cursor()
        events: list[KVCacheEvent] = []
        for tier, reader in self.readers.items():
            announced = self.announced[tier]
            self._checked = {key: held[2] for key, held in announced.items()}
            announced.clear()
            try:
                events.extend(self._follow(tier, reader))
            finally:
                self._checked = {}
        return events
