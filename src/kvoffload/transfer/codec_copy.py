"""Copies between engine KV pages and a host slab of encoded chunks (issue 33).

With a chunk codec (``kvoffload.codecs.chunk_codec``) a host slot holds a chunk's
encoded bytes, not its block records, so the page gathers of
:class:`~kvoffload.transfer.cpu_copy.CpuCopier` cannot address it. :class:`CodecCopier`
runs them against a staging area of raw chunks instead, one staging slot per slot the
plan touches, and encodes or decodes each whole chunk:

- **store** (a store names every block of its chunks, ``core/jobs.py``): the plan's
  blocks are copied into the staging slots; each staging chunk is encoded into its
  host slot;
- **load**: each slot the plan reads is decoded into its staging slot; the plan's
  blocks (all of a chunk's, or those a load names: ``skip_blocks``, ``NO_BLOCK``)
  are copied from there into the engine.

Same interface and mutation contract as ``CpuCopier`` (a store writes only the host
slots its plan names, a load only the engine blocks its plan names). A value the
codec cannot encode (fp8: not finite) raises ``ValueError`` before any host slot of
the plan is written: the job fails, nothing is stored; a slot that does not decode
(``ValueError``: among others a frame whose checksum does not match, issue 41,
``codecs/frame_check.py``) fails its load before any engine block is written, and
the engine recomputes. The check covers host memory and node-shared slabs alike
(every slot this copier reads); a load that batches several jobs fails them all
(the worker fails a batch as a whole). Each direction has its own
staging area, grown to the largest plan seen; the worker's lanes call each direction
from one thread at a time.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from kvoffload.codecs.chunk_codec import ChunkCodec
from kvoffload.core.errors import ContractViolation
from kvoffload.tiers.slot_rows import SlotRows
from kvoffload.transfer.cpu_copy import CpuCopier
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.plan import CopyPlan


def staged_rows(plan: CopyPlan, blocks_per_chunk: int) -> tuple[list[int], np.ndarray]:
    """The host slots ``plan`` touches, ascending, and each of its blocks' row in a
    staging area of those slots' raw chunks, in that order."""
    slots, index = np.unique(plan.rows // blocks_per_chunk, return_inverse=True)
    rows = index.astype(np.int64) * blocks_per_chunk + plan.rows % blocks_per_chunk
    return [int(s) for s in slots], rows


class _Staging(SlotRows):
    """``num_slots`` raw chunks in ordinary memory."""

    def __init__(self, num_slots: int, chunk_bytes: int) -> None:
        self.pinned = False
        self._attach(
            torch.empty(num_slots * chunk_bytes, dtype=torch.uint8), num_slots, chunk_bytes
        )


class CodecCopier:
    """Executes :class:`CopyPlan` s between ``layout``'s pages and the encoded chunks
    of ``slab`` (see the module docstring)."""

    def __init__(
        self,
        layout: KVLayout,
        slab: SlotRows,
        blocks_per_chunk: int,
        codec: ChunkCodec,
        *,
        threads: int,
    ) -> None:
        self.layout = layout
        self.slab = slab
        self.codec = codec
        self.k = blocks_per_chunk
        self._threads = threads
        self._stages: dict[str, tuple[_Staging, CpuCopier]] = {}

    def _stage(self, direction: str, slots: int) -> tuple[_Staging, CpuCopier]:
        held = self._stages.get(direction)
        if held is None or held[0].num_slots < slots:
            if held is not None:
                held[1].close()
            staging = _Staging(slots, self.codec.raw_bytes)
            held = (staging, CpuCopier(self.layout, staging, self.k, threads=self._threads))
            self._stages[direction] = held
        return held

    def _staged(self, plan: CopyPlan) -> tuple[list[int], CopyPlan]:
        """The plan's host slots in order, and the plan on staging rows."""
        slots, rows = staged_rows(plan, self.k)
        return slots, replace(plan, rows=rows)

    def store(self, plan: CopyPlan) -> None:
        slots, staged = self._staged(plan)
        if len(staged.rows) != len(slots) * self.k:
            raise ContractViolation("a store through a codec names every block of its chunks")
        staging, copier = self._stage("store", len(slots))
        copier.store(staged)
        encoded = torch.zeros((len(slots), self.codec.stored_bytes), dtype=torch.uint8)
        for i in range(len(slots)):
            self.codec.encode(staging.data[i], encoded[i])
        for i, slot in enumerate(slots):  # only once every chunk encoded
            self.slab.data[slot].copy_(encoded[i])

    def load(self, plan: CopyPlan) -> None:
        slots, staged = self._staged(plan)
        staging, copier = self._stage("load", len(slots))
        for i, slot in enumerate(slots):
            self.codec.decode(self.slab.data[slot], staging.data[i])
        copier.load(staged)

    def close(self) -> None:
        for _, copier in self._stages.values():
            copier.close()
