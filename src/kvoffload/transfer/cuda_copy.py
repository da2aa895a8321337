"""Copies between GPU KV pages and the pinned host slab, on dedicated CUDA streams.

Untested here: the reference machine has no GPU. Kept small on purpose.

Per direction one stream, so jobs of one direction run in submission order:

- a **store** first makes its stream wait for the engine's current stream (the
  forward pass that wrote the blocks), gathers the job's blocks on the device into a
  staging tensor with one ``index_select`` per page group, then copies each run of
  consecutive slab rows device-to-host with ``non_blocking=True``;
- a **load** also waits for the current stream (so it cannot overwrite blocks a
  queued kernel still reads), copies each run host-to-device into a staging tensor,
  then scatters it with one ``index_copy_`` per page group.

Each copy records a start and an end event; :class:`InFlight` holds them and keeps
the staging and index tensors alive until the end event has completed. A job is
finished (and may be reported) only once ``end.query()`` is true, so a reported load
is in device memory. Everything is enqueued from the submitting thread; nothing here
blocks except :meth:`InFlight.synchronize`.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kvoffload.tiers.slot_rows import SlotRows
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.plan import CopyPlan


@dataclass(frozen=True, eq=False)
class InFlight:
    """An enqueued copy: done when ``end`` has completed. ``finite`` (a store through
    the fp8 codec, ``cuda_codec_copy.py``): a host tensor the copy fills with, per
    chunk, whether its values were finite; :meth:`verify` reads it once done."""

    plan: CopyPlan
    start: torch.cuda.Event
    end: torch.cuda.Event
    keepalive: tuple[torch.Tensor, ...]
    finite: torch.Tensor | None = None

    def done(self) -> bool:
        """Whether the copy completed (raises if the device reported an error)."""
        return bool(self.end.query())  # type: ignore[no-untyped-call]

    def verify(self) -> None:
        """Once done: ``ValueError`` when a chunk it encoded held a value that is not
        finite (its slot holds no chunk: the job fails)."""
        if self.finite is not None and not bool(self.finite.all()):
            raise ValueError("fp8: a KV value is not finite")

    def synchronize(self) -> None:
        self.end.synchronize()

    def seconds(self) -> float:
        return float(self.start.elapsed_time(self.end)) / 1000.0


class CudaCopier:
    """Enqueues :class:`CopyPlan` s between ``layout``'s device pages and ``slab`` rows."""

    def __init__(self, layout: KVLayout, slab: SlotRows, blocks_per_chunk: int) -> None:
        self._device = layout.device
        self._layout = layout
        self._rows = self._slab_rows(slab, blocks_per_chunk)
        self._store_stream = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]
        self._load_stream = torch.cuda.Stream(self._device)  # type: ignore[no-untyped-call]

    def _slab_rows(self, slab: SlotRows, blocks_per_chunk: int) -> torch.Tensor:
        """The slab as rows of one block record each (what the copies address)."""
        return slab.view(self._layout.word).view(slab.num_slots * blocks_per_chunk, -1)

    def store(self, plan: CopyPlan) -> InFlight:
        stream = self._store_stream
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            start = self._event(stream)
            blocks, stage = self._gather(plan)
            for a, b, row in _runs(plan):
                self._rows[row : row + b - a].copy_(stage[a:b], non_blocking=True)
            end = self._event(stream)
        return InFlight(plan, start, end, (blocks, stage))

    def load(self, plan: CopyPlan) -> InFlight:
        stream = self._load_stream
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            start = self._event(stream)
            blocks = torch.from_numpy(plan.blocks).to(self._device, non_blocking=True)
            stage = self._stage(len(plan.blocks))
            for a, b, row in _runs(plan):
                stage[a:b].copy_(self._rows[row : row + b - a], non_blocking=True)
            self._scatter(blocks, stage)
            end = self._event(stream)
        return InFlight(plan, start, end, (blocks, stage))

    def _stage(self, rows: int) -> torch.Tensor:
        """Device rows of block records (uninitialized), on the current stream."""
        return torch.empty(
            (rows, self._layout.block_words), dtype=self._layout.word, device=self._device
        )

    def _gather(self, plan: CopyPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """The plan's engine blocks (a device index) and their records gathered, in
        the plan's order, on the current stream."""
        blocks = torch.from_numpy(plan.blocks).to(self._device, non_blocking=True)
        stage = self._stage(len(plan.blocks))
        for g in self._layout.groups:
            cols = stage[:, g.record_offset : g.record_offset + g.record_words]
            out = cols.view(len(plan.blocks), g.views, g.page_words)
            if out.is_contiguous():  # one group: gather straight into the stage
                torch.index_select(g.pages, 0, blocks, out=out)
            else:
                out.copy_(torch.index_select(g.pages, 0, blocks))
        return blocks, stage

    def _scatter(self, blocks: torch.Tensor, stage: torch.Tensor) -> None:
        """Write ``stage``'s records into the engine ``blocks``, on the current stream."""
        for g in self._layout.groups:
            cols = stage[:, g.record_offset : g.record_offset + g.record_words]
            g.pages.index_copy_(0, blocks, cols.view(len(blocks), g.views, g.page_words))

    @staticmethod
    def _event(stream: torch.cuda.Stream) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(stream)
        return event


def _runs(plan: CopyPlan) -> list[tuple[int, int, int]]:
    """``(start, end, first slab row)`` of every run of consecutive rows."""
    bounds = plan.bounds.tolist()
    return [(a, b, int(plan.rows[a])) for a, b in itertools.pairwise(bounds)]
