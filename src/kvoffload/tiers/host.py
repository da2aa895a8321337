"""The host-memory tier: one preallocated slab of fixed-size chunk slots.

The slab is ``num_slots x chunk_bytes`` bytes in one allocation, slots addressed by
index (the slot numbers the scheduler half's directory hands out). A chunk is
contiguous inside its slot; what the bytes mean (``blocks_per_chunk`` block records,
see :mod:`kvoffload.transfer.layout`) is the transfer worker's business.

Memory: page-locked (pinned) when CUDA is available, so that device copies can be
asynchronous; otherwise an anonymous mapping advised to use transparent huge pages.
With ``prefault`` (the default) every page is touched at construction, so that no
copy pays first-touch page faults (about 1 s per GiB on the reference machine).

Ownership: the slab owns its memory for its whole life. It does no locking: which
slot may be read or written when is decided by the directory's two-phase protocol
(a slot being stored is written by exactly one job and read by none).
"""

from __future__ import annotations

import mmap

import torch

from kvoffload.core.config.capacity import slots_per_rank
from kvoffload.core.errors import ConfigError
from kvoffload.tiers.slot_rows import SlotRows

_PAGE = 4096


class HostSlab(SlotRows):
    """``num_slots`` chunk slots of ``chunk_bytes`` bytes each, in one buffer.

    ``num_slots = budget_bytes // chunk_bytes``; a budget smaller than one chunk is a
    :class:`ConfigError`. ``pin_memory`` defaults to ``torch.cuda.is_available()``.
    """

    def __init__(
        self,
        chunk_bytes: int,
        budget_bytes: int,
        *,
        pin_memory: bool | None = None,
        prefault: bool = True,
    ) -> None:
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes <= 0:
            raise ConfigError("chunk_bytes", f"must be a positive integer, got {chunk_bytes!r}")
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int):
            raise ConfigError("host.budget_bytes", f"must be an integer, got {budget_bytes!r}")
        num_slots = slots_per_rank(budget_bytes, chunk_bytes)
        if num_slots <= 0:
            raise ConfigError(
                "host.budget_bytes",
                f"{budget_bytes} B holds no chunk of {chunk_bytes} B; "
                f"must be at least {chunk_bytes}",
            )
        self.chunk_bytes = chunk_bytes
        self.num_slots = num_slots
        self.pinned = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._buffer: mmap.mmap | None = None
        self._attach(self._allocate(num_slots * chunk_bytes, prefault), num_slots, chunk_bytes)

    def _allocate(self, nbytes: int, prefault: bool) -> torch.Tensor:
        if self.pinned:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        self._buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self._buffer.madvise(mmap.MADV_HUGEPAGE)
        flat = torch.frombuffer(self._buffer, dtype=torch.uint8)
        if prefault:
            flat[::_PAGE] = 0
        return flat
