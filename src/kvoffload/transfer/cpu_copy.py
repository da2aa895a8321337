"""Copies between engine KV pages and the host slab, on the CPU.

Two ways to move one page group (see :mod:`kvoffload.transfer.layout`), chosen per
job from its mean run size (runs: stretches of consecutive slab rows, see
:mod:`kvoffload.transfer.plan`):

- **direct** (mean run at least ``direct_store_min`` / ``direct_load_min`` bytes):
  one pass per run. A store is
  ``torch.index_select(pages, 0, blocks, out=<slab rows of the run>)``; a load is
  the numpy assignment ``pages[blocks] = <slab rows of the run>``, which copies
  whole pages per index (torch's ``index_copy_`` goes element by element and was
  about half as fast here, even on int64 views).
- **bounced** (short runs, e.g. one small chunk per slot): the job is cut into
  pieces of at most ``piece_bytes``; each piece is gathered with one
  ``index_select`` into a per-thread scratch buffer and scattered with one numpy
  assignment. Two passes, but two operator calls per piece instead of per chunk.

Every operator runs single-threaded (:mod:`kvoffload.transfer.threads`); with
``threads > 1`` a job's pieces are split between the calling thread and
``threads - 1`` helper threads. torch and numpy release the GIL while copying.

Mutation: a store writes only the slab rows its plan names, a load only the engine
pages of the blocks its plan names. Concurrency: one store and one load may run at
the same time on different threads (scratch buffers are per thread). An exception
propagates to the caller after every part of the job has stopped.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kvoffload.core.errors import ConfigError
from kvoffload.tiers.host import HostSlab
from kvoffload.transfer.cpu_units import CopyUnits, copy_units
from kvoffload.transfer.layout import KVLayout
from kvoffload.transfer.plan import CopyPlan, Index
from kvoffload.transfer.threads import copy_executor

# Measured on the reference machine (docs/decisions/0003-worker-copies.md): below these
# mean run sizes, per-call overhead (about 10 us per index_select with its slicing,
# 4 us per numpy assignment) makes the bounced path faster.
DIRECT_STORE_MIN = 256 << 10
DIRECT_LOAD_MIN = 128 << 10
PIECE_BYTES = 4 << 20

Segment = tuple[int, int]  # [start, end) indices into a plan's blocks/rows


class CpuCopier:
    """Executes :class:`CopyPlan` s between ``layout``'s pages and ``slab`` rows."""

    def __init__(
        self,
        layout: KVLayout,
        slab: HostSlab,
        blocks_per_chunk: int,
        *,
        threads: int = 1,
        direct_store_min: int = DIRECT_STORE_MIN,
        direct_load_min: int = DIRECT_LOAD_MIN,
        piece_bytes: int = PIECE_BYTES,
    ) -> None:
        if threads < 1:
            raise ConfigError("transfer.threads", f"must be at least 1, got {threads!r}")
        rows = slab.view(layout.word).view(slab.num_slots * blocks_per_chunk, layout.block_words)
        self._groups = copy_units(layout, rows)
        self._block_bytes = layout.block_bytes
        self._word = layout.word
        self._direct_store_min = direct_store_min
        self._direct_load_min = direct_load_min
        self._piece_blocks = max(1, piece_bytes // layout.block_bytes)
        self._threads = threads
        self._helpers: ThreadPoolExecutor | None = (
            copy_executor("kvoffload-copy-helper", threads - 1) if threads > 1 else None
        )
        self._scratch = threading.local()

    def store(self, plan: CopyPlan) -> None:
        """Copy the plan's engine blocks into its slab rows."""
        index = self._indices(plan)
        if _mean_run(plan) >= self._direct_store_min:
            self._run(plan, True, lambda seg: self._store_direct(plan, index, seg))
        else:
            self._run(plan, False, lambda seg: self._store_bounced(index, seg))

    def load(self, plan: CopyPlan) -> None:
        """Copy the plan's slab rows into its engine blocks."""
        index = self._indices(plan)
        if _mean_run(plan) >= self._direct_load_min:
            self._run(plan, True, lambda seg: self._load_direct(plan, index, seg))
        else:
            self._run(plan, False, lambda seg: self._load_bounced(index, seg))

    def close(self) -> None:
        """Stop the helper threads (after the parts they are running)."""
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)

    def _segments(self, plan: CopyPlan, direct: bool) -> list[Segment]:
        """Pieces of at most ``piece_blocks`` blocks; inside runs when going direct."""
        step = self._piece_blocks
        if not direct:
            n = len(plan.blocks)
            return [(a, min(a + step, n)) for a in range(0, n, step)]
        bounds = plan.bounds.tolist()
        return [
            (a, min(a + step, end))
            for start, end in itertools.pairwise(bounds)
            for a in range(start, end, step)
        ]

    def _run(self, plan: CopyPlan, direct: bool, copy: Callable[[Segment], None]) -> None:
        segments = self._segments(plan, direct)
        parts = _split(segments, self._threads)

        def run_part(part: list[Segment]) -> None:
            for segment in part:
                copy(segment)

        helpers = self._helpers
        futures: list[Future[None]] = []
        if helpers is not None:
            futures = [helpers.submit(run_part, part) for part in parts[1:]]
        try:
            run_part(parts[0])
        finally:
            errors = [f.exception() for f in futures]
        for error in errors:
            if error is not None:
                raise error

    def _indices(self, plan: CopyPlan) -> list[_UnitIndex]:
        out = []
        for g in self._groups:
            engine = g.engine_index(plan.blocks)
            slab = g.slab_index(plan.rows)
            out.append(
                _UnitIndex(g, engine, torch.from_numpy(engine), slab, torch.from_numpy(slab))
            )
        return out

    def _store_direct(self, plan: CopyPlan, index: list[_UnitIndex], seg: Segment) -> None:
        for x in index:
            out = x.units.slab[x.slab_run(plan, seg)]
            torch.index_select(x.units.engine, 0, x.engine_t[x.units_of(seg)], out=out)

    def _load_direct(self, plan: CopyPlan, index: list[_UnitIndex], seg: Segment) -> None:
        for x in index:
            x.units.engine_np[x.engine[x.units_of(seg)]] = x.units.slab_np[x.slab_run(plan, seg)]

    def _store_bounced(self, index: list[_UnitIndex], seg: Segment) -> None:
        for x in index:
            span = x.units_of(seg)
            tmp = self._bounce(x.units, span.stop - span.start)
            torch.index_select(x.units.engine, 0, x.engine_t[span], out=tmp)
            x.units.slab_np[x.slab[span]] = tmp.numpy()

    def _load_bounced(self, index: list[_UnitIndex], seg: Segment) -> None:
        for x in index:
            span = x.units_of(seg)
            tmp = self._bounce(x.units, span.stop - span.start)
            torch.index_select(x.units.slab, 0, x.slab_t[span], out=tmp)
            x.units.engine_np[x.engine[span]] = tmp.numpy()

    def _bounce(self, units: CopyUnits, count: int) -> torch.Tensor:
        """This thread's scratch buffer, as ``count`` units."""
        words = self._piece_blocks * self._block_bytes // self._word.itemsize
        buf: torch.Tensor | None = getattr(self._scratch, "buf", None)
        if buf is None:
            buf = torch.zeros(words, dtype=self._word)
            self._scratch.buf = buf
        return buf[: count * units.unit_words].view(count, *units.unit_shape)


@dataclass(frozen=True, eq=False)
class _UnitIndex:
    """One plan's unit indices for one group (numpy for numpy, tensors for torch)."""

    units: CopyUnits
    engine: Index
    engine_t: torch.Tensor
    slab: Index
    slab_t: torch.Tensor

    def units_of(self, seg: Segment) -> slice:
        """Where the segment's blocks are in the unit index arrays."""
        per = self.units.per_block
        return slice(seg[0] * per, seg[1] * per)

    def slab_run(self, plan: CopyPlan, seg: Segment) -> slice:
        """The slab units of a segment inside one run (consecutive rows)."""
        per, row = self.units.per_block, int(plan.rows[seg[0]])
        return slice(row * per, (row + seg[1] - seg[0]) * per)


def _mean_run(plan: CopyPlan) -> float:
    return plan.nbytes / plan.num_runs


def _split(segments: list[Segment], parts: int) -> list[list[Segment]]:
    """Split ``segments`` into ``parts`` consecutive lists of about equal blocks."""
    total = sum(b - a for a, b in segments)
    out: list[list[Segment]] = [[] for _ in range(parts)]
    done = 0
    for seg in segments:
        out[min(parts - 1, done * parts // max(total, 1))].append(seg)
        done += seg[1] - seg[0]
    return out
