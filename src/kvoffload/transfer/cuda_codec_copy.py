"""Copies between GPU KV pages and a pinned host slab of fp8-encoded chunks: the
codec runs on the GPU, before the copy to host on a store and after it on a load, so
half (16-bit KV) or a quarter (32-bit) of the bytes cross PCIe (issue 33, decision
0023).

Untested on this project's machines (no GPU); the codec arithmetic is
:func:`kvoffload.codecs.fp8.encode_batch` / ``decode_batch``, the same functions the
CPU path runs and its tests check, and the staging rows are
:func:`~kvoffload.transfer.codec_copy.staged_rows`, as on the CPU path.
``scripts/gpu-check`` runs it on a GPU.

Same streams, events and ordering as :class:`~kvoffload.transfer.cuda_copy.CudaCopier`:

- a **store** (it names every block of its chunks, ``core/jobs.py``) gathers its
  blocks on the device, places them as raw chunks in slot order, encodes them on the
  device, and copies each encoded chunk to its host slot. Whether each chunk was
  finite is copied to a pinned flag the worker reads once the copy is done
  (:meth:`~kvoffload.transfer.cuda_copy.InFlight.verify`): a chunk that was not fails
  the job, and its slot never becomes readable. Nothing waits for the device here;
- a **load** copies its encoded slots to the device, decodes them there into raw
  chunks, and scatters only the blocks the plan names (``skip_blocks``).
"""

from __future__ import annotations

import torch

from kvoffload.codecs.chunk_codec import Fp8Chunks
from kvoffload.codecs.fp8 import decode_batch, encode_batch
from kvoffload.core.errors import ContractViolation
from kvoffload.tiers.slot_rows import SlotRows
from kvoffload.transfer.codec_copy import staged_rows
from kvoffload.transfer.cuda_copy import CudaCopier, InFlight
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.plan import CopyPlan


class CudaCodecCopier(CudaCopier):
    """Enqueues :class:`CopyPlan` s between ``layout``'s device pages and the fp8
    chunks of ``slab`` (see the module docstring)."""

    def __init__(
        self, layout: KVLayout, slab: SlotRows, blocks_per_chunk: int, codec: Fp8Chunks
    ) -> None:
        super().__init__(layout, slab, blocks_per_chunk)
        self._slab = slab
        self._codec = codec
        self._k = blocks_per_chunk

    def _slab_rows(self, slab: SlotRows, blocks_per_chunk: int) -> torch.Tensor:
        return slab.data  # encoded chunks: addressed by slot, never by block record

    def _raw(self, chunks: torch.Tensor) -> torch.Tensor:
        """Staging rows of whole chunks as ``chunks x elements`` KV values."""
        n = chunks.shape[0] // self._k
        return chunks.view(n, -1).view(torch.uint8).view(self._codec.dtype)

    def store(self, plan: CopyPlan) -> InFlight:
        slots, rows = staged_rows(plan, self._k)
        if len(rows) != len(slots) * self._k:
            raise ContractViolation("a store through a codec names every block of its chunks")
        stream = self._store_stream
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            start = self._event(stream)
            blocks, stage = self._gather(plan)
            index = torch.from_numpy(rows).to(self._device, non_blocking=True)
            chunks = self._stage(len(rows))
            chunks.index_copy_(0, index, stage)
            encoded, finite = encode_batch(self._raw(chunks), self._codec.run)
            flags = torch.empty(len(slots), dtype=torch.bool, pin_memory=True)
            flags.copy_(finite, non_blocking=True)
            for i, slot in enumerate(slots):
                self._slab.data[slot].copy_(encoded[i], non_blocking=True)
            end = self._event(stream)
        return InFlight(plan, start, end, (blocks, stage, index, chunks, encoded), flags)

    def load(self, plan: CopyPlan) -> InFlight:
        slots, rows = staged_rows(plan, self._k)
        stream = self._load_stream
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            start = self._event(stream)
            blocks = torch.from_numpy(plan.blocks).to(self._device, non_blocking=True)
            index = torch.from_numpy(rows).to(self._device, non_blocking=True)
            encoded = torch.empty(
                (len(slots), self._codec.stored_bytes), dtype=torch.uint8, device=self._device
            )
            for i, slot in enumerate(slots):
                encoded[i].copy_(self._slab.data[slot], non_blocking=True)
            chunks = self._stage(len(slots) * self._k)
            decode_batch(encoded, self._codec.dtype, self._codec.run, out=self._raw(chunks))
            stage = chunks.index_select(0, index)
            self._scatter(blocks, stage)
            end = self._event(stream)
        return InFlight(plan, start, end, (blocks, index, encoded, chunks, stage))
