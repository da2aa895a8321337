"""Room for a store: the all-or-nothing choice of the chunks a store evicts.

Pure over what it is given except for what it names: it asks ``policy`` for victims
(the policy forgets them) and drops them from ``table``. The directory owns both and
counts the eviction and emits its event; nothing here counts or raises on a full
tier (it answers None and changes nothing).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.core.directory.slots import _READY, SlotTable
from kvoffload.core.keys import ChunkKey
from kvoffload.core.policies import EvictionPolicy


def evict_for(
    table: SlotTable, policy: EvictionPolicy, needed: int, protected: Sequence[ChunkKey]
) -> tuple[ChunkKey, ...] | None:
    """Evict ``needed`` READY, unpinned chunks not in ``protected`` (the store's own
    keys already present) and return them; None, changing nothing, when there are
    not that many; () when nothing is needed."""
    if needed <= 0:
        return ()
    index, state = table.index, table.state
    shielded = {k for k in protected if state[index[k]] == _READY}
    if table.evictable - len(shielded) < needed:
        return None
    victims = policy.evict(needed, lambda k: k not in shielded and state[index[k]] == _READY)
    table.drop_ready(victims)
    return tuple(victims)
