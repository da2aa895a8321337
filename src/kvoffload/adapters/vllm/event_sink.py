"""Where kvoffload's events go when they cannot wait for an engine step.

vLLM publishes a connector's events only at the end of an engine step
(``Scheduler.update_from_output`` drains ``take_events``). An engine with nothing to
serve takes no step, yet a chunk another engine stored in a node share is loadable by
it now, and a router should hear so within seconds (issue 34). So the share's
announcer hands its events to the engine's own publisher directly: vLLM's
``Scheduler.kv_event_publisher`` (a ZMQ publisher whose ``publish`` only enqueues
for its own thread), the same stream, the same sequence numbers, the same replay
buffer as vLLM's events.

vLLM gives a connector no handle on its scheduler. The connector is built inside
``Scheduler.__init__``, so :func:`find_scheduler` looks up the stack of that call
for the scheduler being built and keeps a weak reference; its publisher, made just
after the connector, is read at each publish. Where none is found (another
scheduler class, a harness) or the publisher refuses, events wait in
:class:`EventSink` until the next ``take_events`` (the step path), counted.

Thread-safety: :meth:`EventSink.publish` may be called from any thread; pending
events are guarded by a lock.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import weakref
from collections.abc import Sequence
from types import FrameType
from typing import Any

from kvoffload.adapters.vllm.compat import KVCacheEvent, KVEventBatch

logger = logging.getLogger("kvoffload")

_SCHEDULER_MODULE = "vllm.v1.core.sched"
_MAX_FRAMES = 40
HOLD_S = 1.0


def find_scheduler() -> weakref.ref[Any] | None:
    """A weak reference to the vLLM scheduler whose ``__init__`` is on the calling
    thread's stack (the connector is being built by it); None when there is none."""
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if (
            owner is not None
            and frame.f_code.co_name == "__init__"
            and type(owner).__module__.startswith(_SCHEDULER_MODULE)
        ):
            try:
                return weakref.ref(owner)
            except TypeError:
                return None
        frame = frame.f_back
    return None


class EventSink:
    """Publishes batches of vLLM events on the engine's own publisher, or keeps them
    for the next step (see the module docstring).

    A publisher is used only from ``hold_s`` after it was first seen: vLLM binds it
    while the engine is being built, and a router's subscriber, which connects when
    it can, would miss what is published at once (ZMQ's publishers drop what no
    subscriber is connected for yet); what comes before waits, in order."""

    def __init__(self, scheduler: weakref.ref[Any] | None, hold_s: float = HOLD_S) -> None:
        self._scheduler = scheduler
        self.hold_s = hold_s
        self._seen_at: float | None = None
        self._lock = threading.Lock()
        self._pending: list[KVCacheEvent] = []  # to publish as soon as a publisher can
        self._after_step: list[KVCacheEvent] = []  # for the next step only
        self.direct = 0  # events handed to the publisher from here
        self.deferred = 0  # events handed to the next step instead

    def _publisher(self) -> Any:
        scheduler = self._scheduler() if self._scheduler is not None else None
        publisher = getattr(scheduler, "kv_event_publisher", None)
        if publisher is None:
            return None
        now = time.monotonic()
        if self._seen_at is None:
            self._seen_at = now
        return publisher if now - self._seen_at >= self.hold_s else None

    def publish(self, events: Sequence[KVCacheEvent], *, defer: bool = False) -> None:
        """Publish ``events`` now, after any that wait (``defer``: at the next step,
        after what vLLM publishes then: a re-announcement after ``AllBlocksCleared``)."""
        with self._lock:
            (self._after_step if defer else self._pending).extend(events)
        if not defer:
            self.flush()

    def flush(self) -> None:
        """Hand what waits to the publisher, if it can take it now."""
        publisher = self._publisher()
        if publisher is None:
            return
        with self._lock:
            pending, self._pending = self._pending, []
            if not pending:
                return
            try:
                publisher.publish(KVEventBatch(ts=time.time(), events=pending))  # type: ignore[arg-type]
                self.direct += len(pending)
            except Exception as exc:  # a closed publisher (shutdown): the step path
                logger.debug("kvoffload: the event publisher refused a batch: %s", exc)
                self._pending = pending + self._pending

    def take(self) -> list[KVCacheEvent]:
        """What waits, for this step's events (in order: then the re-announcements)."""
        with self._lock:
            out = self._pending + self._after_step
            self._pending, self._after_step = [], []
        self.deferred += len(out)
        return out
