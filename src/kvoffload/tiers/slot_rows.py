"""Fixed-size chunk slots over one flat byte buffer, as the transfer worker reads and
writes them: the views that :class:`~kvoffload.tiers.host.HostSlab` (a private slab)
and :class:`~kvoffload.tiers.host_shared_slab.SharedSlab` (a node-shared one) both offer.

A subclass allocates or maps its memory and then calls :meth:`SlotRows._attach` with
``num_slots x chunk_bytes`` bytes; every view returned aliases that memory (no copy)
and lives as long as the subclass keeps it. No locking: which slot may be touched when
is the directory's business.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from kvoffload.core.errors import ContractViolation


class SlotRows:
    """``num_slots`` slots of ``chunk_bytes`` bytes in ``_flat`` (uint8, contiguous)."""

    chunk_bytes: int
    num_slots: int
    pinned: bool  # page-locked for DMA (set by the subclass)
    _flat: torch.Tensor
    _rows: npt.NDArray[np.uint8]

    def _attach(self, flat: torch.Tensor, num_slots: int, chunk_bytes: int) -> None:
        """Take ``flat`` (exactly ``num_slots x chunk_bytes`` uint8) as the slots."""
        self.chunk_bytes = chunk_bytes
        self.num_slots = num_slots
        self._flat = flat
        self._rows = flat.numpy().reshape(num_slots, chunk_bytes)

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.chunk_bytes

    @property
    def data(self) -> torch.Tensor:
        """Every slot as a ``[num_slots, chunk_bytes]`` uint8 tensor (a view)."""
        return self._flat.view(self.num_slots, self.chunk_bytes)

    def view(self, dtype: torch.dtype) -> torch.Tensor:
        """The slots as ``[num_slots, chunk_bytes // itemsize]`` of ``dtype`` (a view).

        ``chunk_bytes`` must be a multiple of the dtype's size (ContractViolation).
        """
        if self.chunk_bytes % dtype.itemsize:
            raise ContractViolation(f"chunk_bytes {self.chunk_bytes} is not a multiple of {dtype}")
        return self._flat.view(dtype).view(self.num_slots, -1)

    def slot_tensor(self, slot: int) -> torch.Tensor:
        """Slot ``slot`` as a writable uint8 tensor view of ``chunk_bytes`` bytes."""
        self._check(slot)
        return self.data[slot]

    def slot_bytes(self, slot: int) -> memoryview:
        """Slot ``slot`` as a writable, zero-copy ``memoryview`` (format ``'B'``).

        For tiers that persist chunks (disk, Redis): write a chunk's bytes into it
        with ``slot_bytes(s)[:] = data`` or ``readinto``; read them with ``bytes(...)``.
        """
        self._check(slot)
        return memoryview(self._rows[slot])

    def _check(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ContractViolation(f"slot {slot} out of range [0, {self.num_slots})")
