"""The units CPU copies index by: whole pages where possible, else whole blocks.

torch's ``index_select`` copies each selected slice with one ``memcpy`` when slices
are contiguous, and with a slower strided loop otherwise; numpy's assignment
likewise. A block of a page group is ``views`` pages far apart (``[views,
page_words]`` with a layer-sized stride), so copies index **pages** (*page units*)
when the layout allows it, and blocks (*block units*) otherwise:

- page units: the engine side is one ``[rows, page_words]`` view of the storage, in
  which page ``v`` of block ``b`` is row ``b * block_rows + v * view_rows``; the slab
  side is the slab as ``[slab_rows * views, page_words]``. Needs a single page group
  (the slab's block record is exactly the group) and strides that are whole pages:
  true for vLLM's CPU layout and a cross-layer tensor. Measured 10-25% faster.
- block units: the engine side is the group's ``[num_blocks, views, page_words]``
  view; the slab side the group's columns of ``[slab_rows, views, page_words]``.

Nothing here copies; :class:`CopyUnits` only holds views and expands indices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from kvoffload.transfer.layout import KVLayout, PageGroup
from kvoffload.transfer.plan import Index


@dataclass(frozen=True, eq=False)
class CopyUnits:
    """One page group as copy units on both sides (views of engine and slab memory).

    ``engine[engine_index(blocks)]`` and ``slab[slab_index(rows)]`` are the same
    units in the same order; ``per_block`` units make one block of the group.
    """

    engine: torch.Tensor
    engine_np: npt.NDArray[np.generic]
    slab: torch.Tensor
    slab_np: npt.NDArray[np.generic]
    per_block: int
    block_rows: int  # page units only: engine rows from one block to the next
    view_rows: int  # page units only: engine rows from one view to the next

    @property
    def unit_shape(self) -> tuple[int, ...]:
        return tuple(self.engine.shape[1:])

    @property
    def unit_words(self) -> int:
        return int(np.prod(self.unit_shape))

    def engine_index(self, blocks: Index) -> Index:
        if self.per_block == 1 and self.block_rows == 0:
            return blocks
        views = np.arange(self.per_block, dtype=np.int64) * self.view_rows
        return (blocks[:, None] * self.block_rows + views[None, :]).ravel()

    def slab_index(self, rows: Index) -> Index:
        if self.per_block == 1:
            return rows
        views = np.arange(self.per_block, dtype=np.int64)
        return (rows[:, None] * self.per_block + views[None, :]).ravel()


def copy_units(layout: KVLayout, slab_words: torch.Tensor) -> list[CopyUnits]:
    """Copy units for every page group; ``slab_words`` is ``[slab_rows, block_words]``."""
    if len(layout.groups) == 1:
        units = _page_units(layout.groups[0], slab_words)
        if units is not None:
            return [units]
    return [_block_units(g, slab_words) for g in layout.groups]


def _page_units(group: PageGroup, slab_words: torch.Tensor) -> CopyUnits | None:
    pages, page = group.pages, group.page_words
    block_stride, view_stride = pages.stride(0), pages.stride(1)
    if block_stride % page or (group.views > 1 and view_stride % page):
        return None
    block_rows = block_stride // page
    view_rows = view_stride // page if group.views > 1 else 0
    num_rows = (pages.shape[0] - 1) * block_rows + (group.views - 1) * view_rows + 1
    engine = pages.as_strided((num_rows, page), (page, 1), pages.storage_offset())
    slab = slab_words.view(-1, page)
    return CopyUnits(engine, engine.numpy(), slab, slab.numpy(), group.views, block_rows, view_rows)


def _block_units(group: PageGroup, slab_words: torch.Tensor) -> CopyUnits:
    cols = slab_words[:, group.record_offset : group.record_offset + group.record_words]
    slab = cols.view(slab_words.shape[0], group.views, group.page_words)
    return CopyUnits(group.pages, group.pages.numpy(), slab, slab.numpy(), 1, 0, 0)
