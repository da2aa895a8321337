"""The share's slots: one shared-memory file per tensor-parallel rank, mapped by
every engine's worker of that rank.

File ``kvoffload-NAME.slab.rR`` (in ``/dev/shm``: memory, not disk), laid out as
:mod:`.slab_files` says.

One file per rank, rather than rank-major regions of one file: a worker maps, prefaults
and registers for DMA only its own rank's memory (1/ranks of the share), and each
rank's file can be placed on its own NUMA node by whoever first touches it. Every
rank uses the same slot numbers (the scheduler half books a slot for all ranks).

:class:`SharedSlab` offers what the transfer worker uses of
:class:`~kvoffload.tiers.host.HostSlab` (``chunk_bytes``, ``num_slots``, ``pinned``,
``nbytes``, ``data``, ``view``, ``slot_tensor``, ``slot_bytes``), so it can stand in
for it. Page-locking: when CUDA is available the mapping is registered with
``cudaHostRegister`` (the driver pins the shared pages for this process; several
processes may register the same pages), and unregistered by :meth:`close`. That path
is not exercised by the tests (they run without CUDA).

Ownership: the node process creates (and sizes) the files (:mod:`.slab_files`);
engines map them and never resize or delete them. Which slot may be read or written
when is decided by the share's directory (two-phase bookings); the slab does no
locking. The bytes of a slot are never trusted without the directory: a restarted
node process starts with an empty directory.
"""

from __future__ import annotations

import mmap
import os

import torch

from kvoffload.core.errors import ConfigError
from kvoffload.share.geometry import ShareGeometry
from kvoffload.share.paths import SharePaths
from kvoffload.share.slab_files import HEADER_BYTES, file_bytes, header
from kvoffload.tiers.slot_rows import SlotRows


class SharedSlab(SlotRows):
    """Rank ``rank``'s slots of a share, mapped into this process (see module doc).

    ``chunk_bytes`` is this engine's chunk size for the rank; it must equal the
    share's slot size (else :class:`ConfigError`, before any memory is touched).
    ``prefault`` reads every page once so no copy pays first-touch faults.
    """

    def __init__(
        self,
        paths: SharePaths,
        geometry: ShareGeometry,
        rank: int,
        chunk_bytes: int,
        *,
        pin_memory: bool | None = None,
        prefault: bool = True,
    ) -> None:
        geometry.check_fits(chunk_bytes, rank)
        self.chunk_bytes = geometry.slot_bytes
        self.num_slots = geometry.num_slots
        self.rank = rank
        fd = os.open(paths.slab(rank), os.O_RDWR)
        try:
            with os.fdopen(os.dup(fd), "rb") as f:
                if f.read(HEADER_BYTES) != header(geometry, rank):
                    raise ConfigError("host_share", f"{paths.slab(rank)} has another geometry")
            self._map = mmap.mmap(fd, file_bytes(geometry), flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self._map.madvise(mmap.MADV_HUGEPAGE)
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        self._attach(whole[HEADER_BYTES:], self.num_slots, self.chunk_bytes)
        if prefault:
            # Read each page (never write: another engine may be writing that byte).
            int(self._flat[:: mmap.PAGESIZE].sum())
        self.pinned = False
        if pin_memory if pin_memory is not None else torch.cuda.is_available():
            self._register()

    def _register(self) -> None:
        """Page-lock the mapping for DMA (CUDA only; untested without a GPU)."""
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        error = cudart.cudaHostRegister(self._flat.data_ptr(), self.nbytes, 0)
        if int(error) != 0:
            raise ConfigError("host_share", f"cudaHostRegister failed ({error})")
        self.pinned = True

    def close(self) -> None:
        """Unregister (CUDA) and drop this process's views; the mapping itself goes
        when the last view does. The file and the others' mappings are untouched."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(  # type: ignore[no-untyped-call]
                self._flat.data_ptr()
            )
            self.pinned = False
