"""An engine's standing with its share's node processes: which node process it is
attached to, what it has booked there, which generations it still holds, its view
of the index, and the slab id of the plan being built.

Owned by one :class:`~kvoffload.share.client.ShareDirectory`, called from its thread
and from its lease's thread (a node process seen dying), so every method takes the
guard. It sends nothing itself: it tells the client what to send.

A node process is known by its identity, ``(generation, slab id)``
(:attr:`~.connection.Welcome.identity`). Rules (see :mod:`.fence` and :mod:`.bookings`):

- attached to a node process, the engine holds its generation's lock (shared); a
  generation it left is released once no booking of it is left (stale bookings
  settle when their transfers complete);
- a new connection to the same session of the same node process keeps the bookings
  (the client then SYNCs them); any other connection makes them stale;
- a booking is only recorded if the node process that answered it is still the one
  attached (else the client refuses it: no transfer into a dead generation's slot);
- the node process attached is lost when the lease sees it go, or finds another one
  serving the share (:meth:`Attachment.moved_to`): an idle engine, whose calls would
  never find out, holds no generation of a node process that is gone;
- **plans** (a scheduler half's directory, ``bind_plans``): every job of one plan
  moves bytes of one slab file, the one whose id the plan names
  (:meth:`seal_plan`, decision 0018). The id of the plan being built is fixed by
  the first connection after the previous plan was sealed; a booking (or a slot
  asked for) answered by a node process of another slab id is refused
  (:attr:`Booking.OFF_PLAN`: the client undoes it) until the next plan.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Sequence

from kvoffload.core.errors import KvOffloadError
from kvoffload.core.keys import ChunkKey
from kvoffload.share.bookings import Booked, Bookings
from kvoffload.share.connection import Welcome
from kvoffload.share.fence import GenerationHold
from kvoffload.share.index import IndexReader
from kvoffload.share.paths import SharePaths

Identity = tuple[int, bytes]


class Booking(enum.Enum):
    BOOKED = "booked"
    DEAD = "dead"  # answered by a node process since gone: nothing to undo there
    OFF_PLAN = "off_plan"  # recorded, but of another slab than the plan's: undo it


class Attachment:
    def __init__(self, paths: SharePaths, *, bind_plans: bool = False, fence: bool = True) -> None:
        self._paths = paths
        self._fence = fence  # hold generation locks (an engine; not an observer)
        self._guard = threading.Lock()
        self.bookings = Bookings()
        self.attached: Welcome | None = None  # the node process the bookings are with
        self._holds: list[tuple[Identity, GenerationHold]] = []
        self._index: IndexReader | None = None
        self._index_of: Identity | None = None
        self.bind_plans = bind_plans
        self._plan_slab: bytes | None = None  # the slab id of the plan being built

    @property
    def generation(self) -> int | None:
        """The attached node process's generation (None: none attached)."""
        attached = self.attached
        return None if attached is None else attached.generation

    @property
    def identity(self) -> Identity | None:
        attached = self.attached
        return None if attached is None else attached.identity

    def connected(self, welcome: Welcome) -> tuple[list[ChunkKey], list[ChunkKey]] | None:
        """A connection opened; the bookings (storing, pins) to SYNC, or None when the
        node process holds none of them (another one, or a new session)."""
        with self._guard:
            same = welcome.identity == self.identity and not welcome.fresh
            if not same:
                self.bookings.lose_current()
                if self._fence and all(identity != welcome.identity for identity, _ in self._holds):
                    hold = GenerationHold(self._paths, welcome.generation)
                    self._holds.append((welcome.identity, hold))
            self.attached = welcome
            if self._plan_slab is None:
                self._plan_slab = welcome.slab_id
            self._release_drained()
            if self._index_of != welcome.identity:
                self._index = _open_index(self._paths)
                self._index_of = welcome.identity
            current = self.bookings.current
            return (list(current.storing), list(current.pins.elements())) if same else None

    def lost(self, welcome: Welcome) -> None:
        """The lease saw the node process that sent ``welcome`` go."""
        with self._guard:
            if welcome.identity == self.identity:
                self.bookings.lose_current()
                self.attached = None
            self._release_drained()

    def moved_to(self, welcome: Welcome) -> bool:
        """The lease found the node process that sent ``welcome`` serving the share.
        If it is not the one attached, that one no longer serves the share's socket
        (the directory was deleted and a new one started, or it died before the lease
        reached it): it is lost, as :meth:`lost` says, so that no generation stays held
        for it by an engine whose calls would never find out (an idle one). Whether the
        caller should reconnect its calls."""
        with self._guard:
            attached = self.attached
            if attached is None or attached.identity == welcome.identity:
                return False
            self.bookings.lose_current()
            self.attached = None
            self._release_drained()
            return True

    def _release_drained(self) -> None:
        if self.bookings.stale:
            return
        keep = []
        for identity, hold in self._holds:
            if identity == self.identity:
                keep.append((identity, hold))
            else:
                hold.release()
        self._holds = keep

    def index(self) -> IndexReader | None:
        """The index, when it is the attached node process's."""
        index, attached = self._index, self.attached
        if index is None or attached is None or self._index_of != attached.identity:
            return None
        return index if index.generation == attached.generation else None

    # ------------------------------------------------------------ plans

    def seal_plan(self) -> bytes | None:
        """The slab id of the plan just built (None: no node process answered while
        it was built, so it books nothing of the share); the next plan's is the
        attached node process's (or the next one's to connect)."""
        with self._guard:
            sealed = self._plan_slab
            attached = self.attached
            self._plan_slab = None if attached is None else attached.slab_id
            return sealed

    def on_plan(self, answered: Welcome | None) -> bool:
        """Whether an answer of ``answered``'s node process may go into the plan being
        built (always, unless plans are bound: then its slab must be the plan's)."""
        with self._guard:
            return self._on_plan(answered)

    def _on_plan(self, answered: Welcome | None) -> bool:
        if not self.bind_plans:
            return True
        return answered is not None and answered.slab_id == self._plan_slab

    # ------------------------------------------------------------ bookings

    def book_pins(self, answered: Welcome | None, keys: Sequence[ChunkKey]) -> Booking:
        """Record pins answered by ``answered``'s node process (see :class:`Booking`)."""
        with self._guard:
            if answered is None or answered.identity != self.identity:
                return Booking.DEAD
            self.bookings.current.pins.update(keys)
            return Booking.BOOKED if self._on_plan(answered) else Booking.OFF_PLAN

    def book_stores(self, answered: Welcome | None, keys: Sequence[ChunkKey]) -> Booking:
        with self._guard:
            if answered is None or answered.identity != self.identity:
                return Booking.DEAD
            self.bookings.current.storing.update(dict.fromkeys(keys))
            return Booking.BOOKED if self._on_plan(answered) else Booking.OFF_PLAN

    def stale_only(self, keys: Sequence[ChunkKey]) -> set[ChunkKey]:
        """Those of ``keys`` this engine pins only under a node process since lost: the
        node process now attached holds no pin of it for this engine, so a slot it
        names for them is not theirs to read."""
        with self._guard:
            b = self.bookings
            return {k for k in keys if b.stale.pins[k] > 0 and b.current.pins[k] <= 0}

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
            for _, hold in self._holds:
                hold.release()
            self._holds = []


def _open_index(paths: SharePaths) -> IndexReader | None:
    try:
        return IndexReader(paths)
    except (OSError, ValueError, KvOffloadError):
        return None
