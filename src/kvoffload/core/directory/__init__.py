"""The chunk directory of one tier, as a package.

- :mod:`.directory`: :class:`Directory`, the tier's bookkeeping (two-phase loads
  and stores, pins, atomic eviction, events); it holds and alone mutates the
  slot table, the admission filter and its events; it counts evictions, admission
  refusals and refused stores in a metrics recorder (``Directory.metrics``).
- :mod:`.host_directory`: :class:`HostDirectory`, the directory as its users see it,
  implemented by :class:`Directory`, the share client and the simulator's shared host
  (each checks its conformance statically), and the eviction hook type.
- :mod:`.slots`: :class:`SlotTable`, key -> slot, per-slot state and pins, the
  free list; queries and the slot primitives the directory calls.
- :mod:`.admission`: :class:`AdmissionFilter`, admission by reuse.
- :mod:`.results`: immutable results (:class:`LookupResult`, :class:`PreparedStore`).
- :mod:`.integrity`: every invariant, checked on demand over what the directory
  passes in (it imports nothing from :mod:`.directory`).

Import dependencies run one way: directory -> integrity -> slots -> results;
directory -> host_directory -> results.
"""

from kvoffload.core.directory.admission import AdmissionFilter
from kvoffload.core.directory.directory import Directory
from kvoffload.core.directory.host_directory import EvictionHook, HostDirectory
from kvoffload.core.directory.results import (
    LookupResult,
    LookupStatus,
    PreparedStore,
)
from kvoffload.core.directory.slots import SlotTable

__all__ = [
    "AdmissionFilter",
    "Directory",
    "EvictionHook",
    "HostDirectory",
    "LookupResult",
    "LookupStatus",
    "PreparedStore",
    "SlotTable",
]
