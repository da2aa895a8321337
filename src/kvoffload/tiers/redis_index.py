"""The scheduler half's view of the Redis/Valkey tier (a :class:`LowerTier`).

Redis is not authoritative: the server evicts by its own policy and other engine
instances add chunks. So the index *asks*: ``present_run`` answers from a short-lived
cache of ``EXISTS`` results and, for keys it does not know, queues a query on a
background thread and answers None ("ask again", which the scheduler half turns
into a bounded deferral). A chunk counts as present when every rank's share exists.
Positive answers live ``ttl_s``; negative ones a tenth of that (another instance may
store the chunk any moment). While the server does not answer (down, slow beyond
its timeout), the index says "absent" for ``retry_s`` without asking, so lookups
never wait on a dead tier.

Thread-safety: the cache is shared between the scheduler's thread and the query
thread under one lock. Owned by one scheduler half; ``close`` stops the thread.
With ``background=False`` there is no thread: queued queries run when the owner calls
:meth:`pump` (deterministic harnesses and fuzzers).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from kvoffload.core.events import CacheEvent, EventKind
from kvoffload.core.keys import ChunkKey
from kvoffload.core.recorder import CounterScope
from kvoffload.core.tiering import SpillBooking, declare_tier_counters
from kvoffload.tiers.redis_client import key_name

MAX_CACHED = 1 << 17
PROBE = 256


class RedisIndex:
    name = "redis"

    def __init__(
        self,
        client: Any,
        namespace_digest: bytes,
        world_size: int,
        *,
        ttl_s: float = 2.0,
        retry_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
        background: bool = True,
    ) -> None:
        self.client = client
        self.digest = namespace_digest
        self.world_size = world_size
        self.ttl_s = ttl_s
        self.retry_s = retry_s
        self.metrics = CounterScope.private(tier=self.name)
        declare_tier_counters(self.metrics)
        self.query_errors = 0
        self._clock = clock
        self._lock = threading.Condition()
        self._known: OrderedDict[ChunkKey, tuple[bool, float]] = OrderedDict()
        self._wanted: dict[ChunkKey, None] = {}
        self._down_until = 0.0
        self._closed = False
        self._events: list[CacheEvent] = []
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(
                target=self._loop, name="kvoffload-redis-index", daemon=True
            )
            self._thread.start()

    # ------------------------------------------------------------ LowerTier

    def present_run(self, keys: Sequence[ChunkKey]) -> int | None:
        now = self._clock()
        with self._lock:
            if now < self._down_until:
                return 0
            for i, key in enumerate(keys):
                entry = self._known.get(key)
                if entry is None or entry[1] < now:
                    for k in keys[i : i + PROBE]:
                        self._wanted[k] = None
                    self._lock.notify()
                    return None
                if not entry[0]:
                    return i
            return len(keys)

    def holds(self, key: ChunkKey) -> bool:
        with self._lock:
            entry = self._known.get(key)
        return entry is not None and entry[0]

    def book_promotion(self, keys: Sequence[ChunkKey]) -> tuple[int, ...]:
        return ()  # nothing to pin: the server may evict, a read then misses

    def release_promotion(self, keys: Sequence[ChunkKey], bad: Sequence[ChunkKey]) -> None:
        self._remember(bad, present=False)
        if bad:
            self._events.append(CacheEvent(EventKind.REMOVED, tuple(bad), self.name))

    def book_spill(self, keys: Sequence[ChunkKey]) -> SpillBooking | None:
        now = self._clock()
        with self._lock:
            fresh = []
            for key in keys:
                entry = self._known.get(key)
                if not (entry is not None and entry[0] and entry[1] >= now):
                    fresh.append(key)
        return SpillBooking(tuple(fresh))

    def complete_spill(self, written: Sequence[ChunkKey], failed: Sequence[ChunkKey]) -> None:
        self._remember(written, present=True)
        self.metrics.count("transferred_chunks_total", len(written), direction="spill")
        self.metrics.count("failed_chunks_total", len(failed), direction="spill")
        if written:
            self._events.append(CacheEvent(EventKind.STORED, tuple(written), self.name))

    def take_events(self) -> list[CacheEvent]:
        events, self._events = self._events, []
        return events

    def reset(self) -> None:
        """Forget what the server was seen to hold (a connector reset changes every
        key's epoch, so the old answers are never asked again)."""
        with self._lock:
            self._known.clear()
            self._wanted.clear()

    def held_count(self) -> int:
        now = self._clock()
        with self._lock:
            return sum(1 for present, expires in self._known.values() if present and expires >= now)

    # ------------------------------------------------------------ internals

    def _remember(self, keys: Sequence[ChunkKey], present: bool) -> None:
        expires = self._clock() + (self.ttl_s if present else self.ttl_s / 10)
        with self._lock:
            for key in keys:
                self._known[key] = (present, expires)
                self._known.move_to_end(key)
            while len(self._known) > MAX_CACHED:
                self._known.popitem(last=False)

    def _loop(self) -> None:
        while True:
            with self._lock:
                self._lock.wait_for(lambda: bool(self._wanted) or self._closed)
                if self._closed:
                    return
            self._query_batch()

    def pump(self) -> None:
        """Answer every queued query now, on the caller's thread (``background=False``)."""
        while self._wanted and not self._closed:
            self._query_batch()

    def _query_batch(self) -> None:
        with self._lock:
            batch = list(self._wanted)[:PROBE]
            for key in batch:
                del self._wanted[key]
        if not batch:
            return
        try:
            present = self._exists(batch)
        except Exception:  # the server is down or slow: absent for a while
            self.query_errors += 1
            with self._lock:
                self._down_until = self._clock() + self.retry_s
            return
        for key, here in zip(batch, present, strict=True):
            self._remember([key], here)

    def _exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            for rank in range(self.world_size):
                pipe.exists(key_name(self.digest, key, rank))
        answers = pipe.execute()
        n = self.world_size
        return [all(answers[i * n : (i + 1) * n]) for i in range(len(keys))]

    def retry_now(self) -> None:
        """Forget the back-off: ask the server again at the next lookup (e.g. after an
        operator restarted it)."""
        with self._lock:
            self._down_until = 0.0

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
