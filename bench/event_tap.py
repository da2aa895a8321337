"""A listener on one engine's vLLM KV event stream that counts what it carries, for
bench/'s event-volume figures (``fleet_router.py``).

vLLM's ZMQ publisher sends one multipart message per event batch: topic, an 8-byte
big-endian sequence number (from 0), and the msgpack-encoded ``KVEventBatch`` (an
array: timestamp, events, data-parallel rank; each event a map tagged by ``type``:
``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``, with its ``medium``: ``GPU``
for vLLM's own block pool, ``CPU`` for host memory, ``STORAGE`` for disk/Redis).

:class:`EventTally` counts decoded batches (no sockets; tests feed it payloads):
per ``(type, medium)`` the events and their bytes (each event encoded alone again:
its share of the batch), the batches and payload bytes, and ``repeats``: a
``BlockStored`` of hash blocks this stream already announced in that medium and has
not removed since (a re-announcement: no news for a router). ``complete`` says the
first batch seen was the stream's first (sequence 0) and no sequence number was
skipped: nothing the publisher sent was missed.

:class:`EventTap` subscribes to ``tcp://127.0.0.1:<port>`` from a thread of its own
(connect it before the engine binds, so that it misses nothing: ZMQ's publisher drops
what no subscriber is connected for yet) and feeds a tally; :meth:`EventTap.stop`
joins the thread and returns the tally. Owned by the caller; the tally is read only
after ``stop``.
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import msgspec

Key = tuple[str, str]  # (event type, medium)


@dataclass
class EventTally:
    """What one event stream carried (see the module docstring)."""

    events: Counter[Key] = field(default_factory=Counter)
    bytes: Counter[Key] = field(default_factory=Counter)
    repeats: Counter[str] = field(default_factory=Counter)  # medium -> repeated stores
    batches: int = 0
    payload_bytes: int = 0
    first_seq: int | None = None
    last_seq: int | None = None
    gaps: int = 0
    held: dict[str, set[tuple[Any, ...]]] = field(default_factory=dict)  # medium -> hashes

    def add(self, seq: int, payload: bytes) -> None:
        """Count one batch (its sequence number and msgpack payload)."""
        if self.first_seq is None:
            self.first_seq = seq
        elif self.last_seq is not None and seq != self.last_seq + 1:
            self.gaps += 1
        self.last_seq = seq
        self.batches += 1
        self.payload_bytes += len(payload)
        batch = msgspec.msgpack.decode(payload)
        for event in batch[1]:
            kind = str(event.get("type"))
            medium = str(event.get("medium"))
            self.events[kind, medium] += 1
            self.bytes[kind, medium] += len(msgspec.msgpack.encode(event))
            hashes = tuple(event.get("block_hashes") or ())
            held = self.held.setdefault(medium, set())
            if kind == "BlockStored":
                if hashes in held:
                    self.repeats[medium] += 1
                held.add(hashes)
            elif kind == "BlockRemoved":
                held.discard(hashes)
            elif kind == "AllBlocksCleared":
                self.held.clear()

    @property
    def complete(self) -> bool:
        """Every batch from the stream's first was seen."""
        return self.first_seq == 0 and self.gaps == 0

    def of(self, medium: str) -> dict[str, int]:
        """``medium``'s counts: stored, removed, repeats (stores), events, bytes."""
        stored = self.events["BlockStored", medium]
        removed = self.events["BlockRemoved", medium]
        size = self.bytes["BlockStored", medium] + self.bytes["BlockRemoved", medium]
        return {
            "stored": stored,
            "removed": removed,
            "repeats": self.repeats[medium],
            "events": stored + removed,
            "bytes": size,
        }


class EventTap:
    """A subscriber thread feeding an :class:`EventTally` (see the module docstring)."""

    def __init__(self, port: int) -> None:
        import zmq

        self.tally = EventTally()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.connect(f"tcp://127.0.0.1:{port}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"event-tap-{port}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import zmq

        while True:
            if not self._socket.poll(100):
                if self._stop.is_set():  # and 100 ms without a message: done
                    return
                continue
            while True:
                try:
                    _, seq, payload = self._socket.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self.tally.add(int.from_bytes(seq, "big"), payload)

    def stop(self) -> EventTally:
        """Stop listening once 100 ms pass without a message (what is still on its way
        is counted) and return the tally."""
        self._stop.set()
        self._thread.join()
        self._socket.close(linger=0)
        self._context.term()
        return self.tally
