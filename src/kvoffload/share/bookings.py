"""What one engine has booked in its share: pins and slots being stored, by
connection life.

``current``: bookings the node process knows (made on the connection's session).
``stale``: bookings of a session the node process lost (it restarted, and released
them). A completion of a stale booking is settled here, never sent: the node process
that booked it is gone, and a successor must not take a completion of its
predecessor's slot for one of its own. Owned by one
:class:`~kvoffload.share.client.ShareDirectory`, which serializes access (a lease
thread may move current to stale).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvoffload.core.keys import ChunkKey


@dataclass
class Booked:
    pins: Counter[ChunkKey] = field(default_factory=Counter)
    storing: dict[ChunkKey, None] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.pins) or bool(self.storing)

    @property
    def pin_count(self) -> int:
        return sum(self.pins.values())


@dataclass
class Bookings:
    current: Booked = field(default_factory=Booked)
    stale: Booked = field(default_factory=Booked)

    def lose_current(self) -> None:
        """The node process no longer holds the current bookings."""
        self.stale.pins.update(self.current.pins)
        self.stale.storing.update(self.current.storing)
        self.current = Booked()

    def settle_loads(self, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        """Settle ``keys``' pins that are stale; the keys left to send."""
        left = []
        for key in keys:
            if self.stale.pins[key] > 0:
                self.stale.pins[key] -= 1
                if not self.stale.pins[key]:
                    del self.stale.pins[key]
            else:
                left.append(key)
        return left

    def settle_stores(self, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        """Settle ``keys``' stale stores; the keys left to send."""
        left = []
        for key in keys:
            if key in self.stale.storing:
                del self.stale.storing[key]
            else:
                left.append(key)
        return left

    @property
    def pin_count(self) -> int:
        return self.current.pin_count + self.stale.pin_count

    @property
    def storing_count(self) -> int:
        return len(self.current.storing) + len(self.stale.storing)
