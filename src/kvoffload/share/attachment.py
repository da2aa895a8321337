"""An engine's standing with its share's node processes: which generation it is
attached to, what it has booked there, which generations it still holds, and its
view of the index.

Owned by one :class:`~kvoffload.share.client.ShareDirectory`, called from its thread
and from its lease's thread (a node process seen dying), so every method takes the
guard. It sends nothing itself: it tells the client what to send.

Rules (see :mod:`.fence` and :mod:`.bookings`):

- attached to a generation, the engine holds that generation's lock (shared); a
  generation it left is released once no booking of it is left (stale bookings
  settle when their transfers complete);
- a new connection to the same session of the same node process keeps the bookings
  (the client then SYNCs them); any other connection makes them stale;
- a booking is only recorded if the node process that answered it is still the one
  attached (else the client refuses it: no transfer into a dead generation's slot).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvoffload.core.keys import ChunkKey
from kvoffload.share.bookings import Booked, Bookings
from kvoffload.share.fence import GenerationHold
from kvoffload.share.index import IndexReader
from kvoffload.share.link import Welcome
from kvoffload.share.paths import SharePaths


class Attachment:
    def __init__(self, paths: SharePaths) -> None:
        self._paths = paths
        self._guard = threading.Lock()
        self.bookings = Bookings()
        self.generation: int | None = None  # of the node process the bookings are with
        self._holds: list[GenerationHold] = []
        self._index: IndexReader | None = None

    def connected(self, welcome: Welcome) -> tuple[list[ChunkKey], list[ChunkKey]] | None:
        """A connection opened; the bookings (storing, pins) to SYNC, or None when the
        node process holds none of them (another one, or a new session)."""
        with self._guard:
            same = welcome.generation == self.generation and not welcome.fresh
            if not same:
                self.bookings.lose_current()
                if all(h.generation != welcome.generation for h in self._holds):
                    self._holds.append(GenerationHold(self._paths, welcome.generation))
            self.generation = welcome.generation
            self._release_drained()
            if self._index is None:
                self._index = _open_index(self._paths)
            current = self.bookings.current
            return (list(current.storing), list(current.pins.elements())) if same else None

    def lost(self, generation: int) -> None:
        """The lease saw generation ``generation``'s node process go."""
        with self._guard:
            if generation == self.generation:
                self.bookings.lose_current()
                self.generation = None
            self._release_drained()

    def _release_drained(self) -> None:
        if self.bookings.stale:
            return
        keep = []
        for hold in self._holds:
            if hold.generation == self.generation:
                keep.append(hold)
            else:
                hold.release()
        self._holds = keep

    def index(self) -> IndexReader | None:
        """The index, when it is the attached node process's."""
        index, generation = self._index, self.generation
        if index is None or generation is None or index.generation != generation:
            return None
        return index

    # ------------------------------------------------------------ bookings

    def book_pins(self, answered: Welcome | None, keys: Sequence[ChunkKey]) -> bool:
        """Record pins answered by ``answered``'s node process; False if it is gone."""
        with self._guard:
            if answered is None or answered.generation != self.generation:
                return False
            self.bookings.current.pins.update(keys)
            return True

    def book_stores(self, answered: Welcome | None, keys: Sequence[ChunkKey]) -> bool:
        with self._guard:
            if answered is None or answered.generation != self.generation:
                return False
            self.bookings.current.storing.update(dict.fromkeys(keys))
            return True

    def start_completing(
        self, keys: Sequence[ChunkKey], loads: bool
    ) -> tuple[Booked, list[ChunkKey]]:
        """Settle the stale ones of ``keys``; the current bookings and the keys to send."""
        with self._guard:
            b = self.bookings
            send = b.settle_loads(keys) if loads else b.settle_stores(keys)
            self._release_drained()
            return b.current, send

    def completed(self, booked: Booked, sent: Sequence[ChunkKey], loads: bool) -> None:
        """``sent`` were completed (answered or not: a booking whose completion went
        unanswered is released by the next SYNC, or with its session)."""
        with self._guard:
            if self.bookings.current is booked:
                if loads:
                    booked.pins.subtract(sent)
                    for key in set(sent):
                        if booked.pins[key] <= 0:
                            del booked.pins[key]
                else:
                    for key in sent:
                        del booked.storing[key]
            elif loads:  # the lease made them stale meanwhile
                self.bookings.settle_loads(sent)
            else:
                self.bookings.settle_stores(sent)
            self._release_drained()

    def close(self) -> None:
        with self._guard:
            for hold in self._holds:
                hold.release()
            self._holds = []


def _open_index(paths: SharePaths) -> IndexReader | None:
    try:
        return IndexReader(paths.index)
    except (OSError, ValueError):
        return None
