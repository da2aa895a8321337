"""The scheduler half's view of a remote lower tier (a :class:`LowerTier`): a store
that answers whether chunks exist (an :class:`ExistenceQuery`), e.g. the Redis/Valkey
tier's (``tiers/redis_index.py``).

A remote store is not authoritative: it evicts by its own policy and other engine
instances add chunks. The index keeps a bounded cache (``MAX_CACHED`` entries, the
least recently learnt pushed out first) of what it knows:

- chunks this engine wrote (``complete_spill``) or read back (``release_promotion``
  without finding them missing) are present until a read of them misses, they are
  pushed out, or ``reset``;
- what a probe (one :meth:`ExistenceQuery.exists` of a batch of keys) answered:
  present for ``ttl_s``, absent for a tenth of that (another instance may store the
  chunk any moment).

``present_run`` answers from the cache up to the first unknown key, then probes the
unknown keys from there (at most ``PROBE``, up to the first known-absent one):

- ``probe="sync"`` (production): in the call, one round trip (about 100 µs for Redis
  on loopback). A probe slower than ``sync_probe_s`` (measured on ``clock``) still
  answers; lookups then probe in the background (below) for ``retry_s``, so a slow
  store costs at most one slow lookup per ``retry_s``.
- ``probe="async"``, or a sync index in its background spell: the keys are queued
  and the call answers None ("ask again", a one-step deferral in the scheduler half);
  the query thread answers them, or :meth:`RemoteIndex.pump` with
  ``background=False``.

None is answered only while a probe of the key is queued or in flight. A probe that
raises (store down, slower than its client's timeout, refused credentials) is a
miss and a back-off: for ``retry_s`` every lookup answers 0 at once, without asking
(what the cache knows is kept for later); after that a sync index probes in the
background until one probe answers, so a store that hangs never stalls two lookups
in a row. Nothing raises out of the index's lookups; ``query_errors`` counts failed
probes.

Counters (``metrics``, besides the tier counters): ``probes_total`` (round trips),
``probed_keys_total`` (chunks asked about), ``lookup_deferrals_total`` (lookups
answered None).

Mutates only its own state: the cache, the queue, the back-off, its events and its
counters. Thread-safety: one lock guards the cache, the queue, the back-off and the
probe counters, shared by the scheduler's thread and the query thread; no I/O is done
holding it; events are the scheduler thread's. ``reset`` makes
answers of probes in flight be dropped. Owned by one scheduler half; ``close`` stops
the thread (lookups then never defer).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from kvoffload.core.keys import ChunkKey
from kvoffload.core.observe.events import CacheEvent, EventKind
from kvoffload.core.observe.recorder import CounterScope
from kvoffload.core.tiering.lower import SpillBooking, declare_tier_counters

__all__ = ["MAX_CACHED", "PROBE", "ExistenceQuery", "RemoteIndex", "RemoteIndexOptions"]

MAX_CACHED = 1 << 17
PROBE = 256
LASTING = math.inf  # the expiry of what this engine wrote or read back


class ExistenceQuery(Protocol):
    """How a remote store answers whether chunks exist. ``exists`` returns, for each of
    ``keys`` (at most ``PROBE``, in order), whether the store holds the whole chunk now
    (every rank's share of it): one round trip, no side effect on the store. It raises
    when the store failed as a whole (down, slower than its timeout, refused
    credentials; any exception: the index counts a miss and backs off). It may be
    called from the scheduler's thread and the index's query thread at once."""

    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]: ...


@dataclass(frozen=True)
class RemoteIndexOptions:
    """How a :class:`RemoteIndex` probes (module docstring): how long a probe's
    ``present`` answer lives (``ttl_s``; ``absent``: a tenth of it), the back-off after
    a failed probe and the background spell after a slow one (``retry_s``), what a slow
    probe is (``sync_probe_s``), ``probe`` ``"sync"`` or ``"async"``, the ``clock``
    (seconds) and whether a query thread answers deferred lookups (``background``;
    False: :meth:`RemoteIndex.pump` does). An unknown ``probe`` is a ``ValueError``."""

    ttl_s: float = 2.0
    retry_s: float = 2.0
    sync_probe_s: float = 0.005
    probe: Literal["sync", "async"] = "sync"
    clock: Callable[[], float] = time.monotonic
    background: bool = True

    def __post_init__(self) -> None:
        if self.probe not in ("sync", "async"):
            raise ValueError(f"probe={self.probe!r}; accepted: 'sync', 'async'")


class RemoteIndex:
    """The lower-tier index of tier ``name`` over the store that ``query`` asks
    (module docstring). Owns its cache, queue, counters and query thread (started
    here unless ``options.background`` is False); ``query`` is the caller's, used
    until :meth:`close`."""

    def __init__(
        self, name: str, query: ExistenceQuery, options: RemoteIndexOptions | None = None
    ) -> None:
        self.name = name
        self.query = query
        self.options = options = options if options is not None else RemoteIndexOptions()
        self.metrics = CounterScope.private(tier=self.name)
        declare_tier_counters(self.metrics)
        self.metrics.declare("probes_total", "probed_keys_total", "lookup_deferrals_total")
        self.query_errors = 0
        self._clock = options.clock
        self._lock = threading.Condition()
        self._known: OrderedDict[ChunkKey, tuple[bool, float]] = OrderedDict()
        self._wanted: dict[ChunkKey, None] = {}  # queued for the query thread / pump
        self._asking: set[ChunkKey] = set()  # in the query thread's probe now
        self._down_until = 0.0  # a probe raised: unknown keys are absent until then
        self._async_until = 0.0  # a sync index probes in the background until then
        self._epoch = 0  # bumped by reset: answers of older probes are dropped
        self._closed = False
        self._events: list[CacheEvent] = []
        self._thread: threading.Thread | None = None
        if options.background:
            self._thread = threading.Thread(
                target=self._loop, name=f"kvoffload-{name}-index", daemon=True
            )
            self._thread.start()

    # ------------------------------------------------------------ LowerTier

    def present_run(self, keys: Sequence[ChunkKey]) -> int | None:
        now = self._clock()
        with self._lock:
            if now < self._down_until:
                return 0  # down: absent, without asking
            run, unknown = self._known_run(keys, now)
            if not unknown or self._closed:
                return run
            batch = self._unknown_window(keys, run, now)
            if self.options.probe == "async" or now < self._async_until:
                self._defer(batch)
                return None
            epoch = self._epoch
        began = self._clock()
        if not self._probe(batch, epoch):
            return 0  # failed: backing off (a miss)
        took = self._clock() - began
        with self._lock:
            if took > self.options.sync_probe_s:
                self._async_until = max(self._async_until, self._clock() + self.options.retry_s)
            run, _ = self._known_run(keys, now)  # an unknown key past the window ends it
            return run

    def holds(self, key: ChunkKey) -> bool:
        with self._lock:
            entry = self._known.get(key)
        return entry is not None and entry[0]

    def book_promotion(self, keys: Sequence[ChunkKey]) -> tuple[int, ...]:
        return ()  # nothing to pin: the store may evict, a read then misses

    def release_promotion(self, keys: Sequence[ChunkKey], bad: Sequence[ChunkKey]) -> None:
        missed = set(bad)
        self._remember([k for k in keys if k not in missed], present=True, lasting=True)
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
        self._remember(written, present=True, lasting=True)
        self.metrics.count("transferred_chunks_total", len(written), direction="spill")
        self.metrics.count("failed_chunks_total", len(failed), direction="spill")
        if written:
            self._events.append(CacheEvent(EventKind.STORED, tuple(written), self.name))

    def take_events(self) -> list[CacheEvent]:
        events, self._events = self._events, []
        return events

    def reset(self) -> None:
        """Forget what the store was seen to hold (a connector reset changes every
        key's epoch, so the old answers are never asked again)."""
        with self._lock:
            self._known.clear()
            self._wanted.clear()
            self._asking.clear()
            self._epoch += 1

    def held_count(self) -> int:
        now = self._clock()
        with self._lock:
            return sum(1 for present, expires in self._known.values() if present and expires >= now)

    # ------------------------------------------------------------ lookups (lock held)

    def _known_run(self, keys: Sequence[ChunkKey], now: float) -> tuple[int, bool]:
        """How many leading ``keys`` are known present, and whether the next one is
        unknown (False: known absent, or the end)."""
        for i, key in enumerate(keys):
            entry = self._known.get(key)
            if entry is None or entry[1] < now:
                return i, True
            if not entry[0]:
                return i, False
        return len(keys), False

    def _unknown_window(self, keys: Sequence[ChunkKey], start: int, now: float) -> list[ChunkKey]:
        """The unknown keys from ``keys[start]`` (unknown): at most ``PROBE``, up to
        the first known-absent key."""
        batch: list[ChunkKey] = []
        for key in keys[start:]:
            entry = self._known.get(key)
            if entry is None or entry[1] < now:
                batch.append(key)
                if len(batch) == PROBE:
                    break
            elif not entry[0]:
                break
        return batch

    def _defer(self, batch: list[ChunkKey]) -> None:
        """Queue ``batch`` (what is not asked already) for the query thread or pump."""
        for key in batch:
            if key not in self._asking:
                self._wanted[key] = None
        self._lock.notify()
        self.metrics.count("lookup_deferrals_total")

    # ------------------------------------------------------------ probes

    def _probe(self, batch: Sequence[ChunkKey], epoch: int) -> bool:
        """Ask the store about ``batch`` (lock not held) and remember the answers
        unless a reset came in between; False when the probe raised (backing off)."""
        try:
            present = self.query.exists(batch)
        except Exception:  # down, slow beyond its timeout, refused: a miss
            with self._lock:
                self.query_errors += 1
                self.metrics.count("probes_total")
                self.metrics.count("probed_keys_total", len(batch))
                self._down_until = self._clock() + self.options.retry_s
                self._wanted.clear()  # answered absent while down; asked again after
                if self.options.probe == "sync":  # sync again once a background probe answers
                    self._async_until = math.inf
            return False
        with self._lock:
            self.metrics.count("probes_total")
            self.metrics.count("probed_keys_total", len(batch))
            if epoch == self._epoch:
                self._remember_locked(
                    [k for k, here in zip(batch, present, strict=True) if here], True, False
                )
                self._remember_locked(
                    [k for k, here in zip(batch, present, strict=True) if not here], False, False
                )
        return True

    def _remember(self, keys: Sequence[ChunkKey], present: bool, lasting: bool = False) -> None:
        with self._lock:
            self._remember_locked(keys, present, lasting)

    def _remember_locked(self, keys: Sequence[ChunkKey], present: bool, lasting: bool) -> None:
        if lasting:
            expires = LASTING
        else:
            expires = self._clock() + (self.options.ttl_s if present else self.options.ttl_s / 10)
        for key in keys:
            self._known[key] = (present, expires)
            self._known.move_to_end(key)
        while len(self._known) > MAX_CACHED:
            self._known.popitem(last=False)

    # ------------------------------------------------------------ background

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
            self._asking.update(batch)
            epoch = self._epoch
        if not batch:
            return
        answered = self._probe(batch, epoch)
        with self._lock:
            self._asking.difference_update(batch)
            if answered and self._async_until == math.inf:
                self._async_until = 0.0  # the store answers again: sync probes resume

    def retry_now(self) -> None:
        """Forget the back-off: ask the store again at the next lookup (e.g. after an
        operator restarted it)."""
        with self._lock:
            self._down_until = 0.0
            self._async_until = 0.0

    def close(self) -> None:
        """Stop the query thread (waiting up to 5 s for a probe in flight); lookups
        then never defer. The store (``query``) is the caller's to close."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=5)
