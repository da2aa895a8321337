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

Every fp8 chunk carries a checksum of its scales and values (issue 41,
``codecs/frame_check.py``), computed and checked where the bytes are on the host,
on the thread that submits and collects the jobs (no xxh3 runs on the device):

- a store copies the encoded payload behind the slot's 8-byte header; once the copy
  is done, :meth:`SealedStore.verify` (the worker calls it before it reports the job)
  checks the finite flags and then writes each slot's checksum, so a slot is sealed
  before the scheduler half can hand it to any load;
- a load checks each slot's checksum on the host before it enqueues the copy: a slot
  that fails raises ``CorruptChunk`` (a ``ValueError``) there, nothing is enqueued,
  the job fails and the engine recomputes (the CPU path's outcome). What the check
  guards is the slot as it stands when the load is submitted: the chunk is pinned by
  the load from then on, so no store of kvoffload writes it until the copy is done;
  a process that writes a pinned slot all the same (a ``host_share_group`` member
  with a bug) between the check and the copy is not caught (the CPU path has the
  same window between its check and its decode). Checking after the copy would need
  the bytes on the host twice, or xxh3 on the device.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvoffload.codecs import FRAME_CHECK_BYTES
from kvoffload.codecs.chunk_codec import Fp8Chunks
from kvoffload.codecs.fp8 import decode_batch, encode_batch
from kvoffload.core.errors import ContractViolation
from kvoffload.tiers.slot_rows import SlotRows
from kvoffload.transfer.codec_copy import staged_rows
from kvoffload.transfer.cuda_copy import CudaCopier, InFlight
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.plan import CopyPlan


@dataclass(frozen=True, eq=False)
class SealedStore(InFlight):
    """A store through fp8: once done, :meth:`verify` checks that every chunk was
    finite, then ``seal`` writes the slots' checksums (none when one was not: the job
    fails and its slots hold no chunk)."""

    seal: Callable[[], None] | None = None

    def verify(self) -> None:
        super().verify()
        if self.seal is not None:
            self.seal()


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
                self._codec.payload(self._slab.data[slot]).copy_(encoded[i], non_blocking=True)
            end = self._event(stream)
        keep = (blocks, stage, index, chunks, encoded)
        return SealedStore(plan, start, end, keep, flags, lambda: self._seal(slots))

    def _seal(self, slots: list[int]) -> None:
        """Write the checksum of each slot's payload (the copy is done)."""
        for slot in slots:
            self._codec.seal(self._slab.data[slot])

    def load(self, plan: CopyPlan) -> InFlight:
        """``CorruptChunk`` (nothing enqueued) when a slot fails its checksum."""
        slots, rows = staged_rows(plan, self._k)
        for slot in slots:
            self._codec.check(self._slab.data[slot])
        stream = self._load_stream
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            start = self._event(stream)
            blocks = torch.from_numpy(plan.blocks).to(self._device, non_blocking=True)
            index = torch.from_numpy(rows).to(self._device, non_blocking=True)
            size = self._codec.stored_bytes - FRAME_CHECK_BYTES
            encoded = torch.empty((len(slots), size), dtype=torch.uint8, device=self._device)
            for i, slot in enumerate(slots):
                encoded[i].copy_(self._codec.payload(self._slab.data[slot]), non_blocking=True)
            chunks = self._stage(len(slots) * self._k)
            decode_batch(encoded, self._codec.dtype, self._codec.run, out=self._raw(chunks))
            stage = chunks.index_select(0, index)
            self._scatter(blocks, stage)
            end = self._event(stream)
        return InFlight(plan, start, end, (blocks, index, encoded, chunks, stage))
