"""The life of one slot of a tier, as an explicit state machine.

::

      prepare_store            complete_store(ok)        prepare_load
  FREE ─────────────▶ STORING ──────────────────▶ READY ─────────────▶ PINNED ──┐
   ▲                     │                        │  ▲                  │  ▲     │ more pins /
   │  complete_store     │                        │  └──────────────────┘  └─────┘ unpins
   └─────(failed)────────┘                        │      complete_load (last pin)
   ▲                                              │
   └──────────────────────── evict / discard ─────┘
   ▲
   └──── complete_load (last pin) of a chunk discarded while pinned ── PINNED

PINNED means pinned for reading: every job reading the chunk's slot (a load to the
engine, a spill from host memory, a promotion from a lower tier) holds one pin,
taken by ``prepare_load`` and dropped by ``complete_load``. Only READY chunks are
evictable. STORING chunks look up as HIT_PENDING; READY and PINNED chunks as HIT.
Values are storage codes (kept in a bytearray per slot, never persisted; names appear
only in error messages); logic never compares them by order.
"""

from __future__ import annotations

import enum

from kvoffload.core.errors import IllegalTransition


class ChunkState(enum.IntEnum):
    FREE = 0
    STORING = 1
    READY = 2
    PINNED = 3


_S = ChunkState
TRANSITIONS: dict[tuple[ChunkState, ChunkState], str] = {
    (_S.FREE, _S.STORING): "prepare_store allocates the slot",
    (_S.STORING, _S.READY): "complete_store(success=True)",
    (_S.STORING, _S.FREE): "complete_store(success=False), or a store completing after discard",
    (_S.READY, _S.PINNED): "prepare_load pins the first time",
    (_S.PINNED, _S.PINNED): "another pin, or an unpin that is not the last",
    (_S.PINNED, _S.READY): "complete_load drops the last pin",
    (_S.PINNED, _S.FREE): "complete_load drops the last pin of a discarded chunk",
    (_S.READY, _S.FREE): "evicted or discarded",
}
_ALLOWED = frozenset((int(a), int(b)) for a, b in TRANSITIONS)


def check_transition(current: int, target: ChunkState) -> None:
    """Raise :class:`IllegalTransition` unless ``current -> target`` is in the table."""
    if (current, int(target)) not in _ALLOWED:
        raise IllegalTransition(
            f"chunk state {ChunkState(current).name} -> {target.name} is not allowed"
        )
