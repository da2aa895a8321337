"""The engine's KV layout: every block's byte pages, as strided views, and its digest.

:func:`register_kv_caches` takes the engine's per-layer KV tensors (layer name ->
tensor) and ``num_blocks`` and derives, *without copying*, where each engine block's
bytes live. The rule, applied to every tensor:

- the **block dimension** is the first dimension whose size equals ``num_blocks``;
- each index of the dimensions *before* it is a separate **page view** (so a
  ``[2, num_blocks, ...]`` tensor has a K view and a V view);
- the dimensions *after* it must be contiguous: one block of one view is one
  contiguous **page** of bytes.

This covers vLLM's CPU layout (per layer ``[num_blocks, heads, block_size,
2*head_size]``, all layers views of one shared storage), GPU-style per-layer
``[2, num_blocks, block_size, heads, dim]`` tensors, and one cross-layer tensor
``[num_blocks, num_layers, ...]``. Anything else raises :class:`ConfigError`.

Consecutive page views of one storage with equal page size and block stride and a
uniform offset step are merged into one :class:`PageGroup`: a single strided view
``[num_blocks, views, page_words]``, so that one gather moves a block across all of
them (for vLLM's CPU layout: one group for all layers). Pages are viewed as the
widest integer dtype that divides every page, stride and offset (int64 normally);
byte-wise index copies are several times slower.

A **block record** is the concatenation of one block's pages over all page views, in
registration order (layer order, then the order of the dimensions before the block
dimension). Host chunks are ``blocks_per_chunk`` records back to back. The
**digest** names exactly that byte format: per layer its dtype and its shape with the
block dimension elided, in order (hence the layer count and page sizes). It does not
depend on ``num_blocks``, on where the tensors live, on their names, or on
``blocks_per_chunk``; it becomes ``Namespace.layout``.

Ownership: the layout only views the engine's tensors; the engine owns them and must
keep them alive (and in place) as long as the layout is used. A layer whose tensor
is exactly another layer's (same storage, offset, shape, strides and dtype) adds no
page view: vLLM's hybrid KV cache manager gives one layer of every KV cache group
the same tensor (a block belongs to one group at a time, so block ``b``'s bytes are
the same memory whichever group holds it), and KV sharing between layers does the
same. Such aliases are named in the digest (``alias=<layer index>``), so a layout
with aliases never reads chunks written without them.
"""

from __future__ import annotations

import hashlib
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from kvoffload.core.errors import ConfigError

LAYOUT_FORMAT = "kvoffload/kv-layout/v1"
_WORD_DTYPES = (torch.int64, torch.int32, torch.int16, torch.uint8)


@dataclass(frozen=True, eq=False)
class PageGroup:
    """Page views of one storage at uniform strides, as one strided tensor.

    ``pages[b, v]`` is page view ``v`` of engine block ``b``: ``page_words`` words of
    the engine's memory (writing into it writes the engine's KV cache). Inside a
    block record the group occupies words ``[record_offset, record_offset +
    record_words)``.
    """

    pages: torch.Tensor
    record_offset: int

    @property
    def views(self) -> int:
        return int(self.pages.shape[1])

    @property
    def page_words(self) -> int:
        return int(self.pages.shape[2])

    @property
    def record_words(self) -> int:
        return self.views * self.page_words


@dataclass(frozen=True, eq=False)
class KVLayout:
    """Where every engine block's bytes live, and the byte format of a block record.

    Immutable; built by :func:`register_kv_caches`. ``word`` is the integer dtype all
    copies use; ``block_words`` is the size of one block record in words.
    """

    num_blocks: int
    word: torch.dtype
    groups: tuple[PageGroup, ...]
    block_words: int
    num_layers: int
    description: str
    digest: str = field(init=False)

    def __post_init__(self) -> None:
        digest = hashlib.blake2b(self.description.encode(), digest_size=16).hexdigest()
        object.__setattr__(self, "digest", digest)

    @property
    def device(self) -> torch.device:
        return self.groups[0].pages.device

    @property
    def word_bytes(self) -> int:
        return self.word.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one block record (one engine block over all page views)."""
        return self.block_words * self.word_bytes

    def chunk_bytes(self, blocks_per_chunk: int) -> int:
        """Bytes of one host chunk of ``blocks_per_chunk`` block records."""
        if blocks_per_chunk <= 0:
            raise ConfigError(
                "blocks_per_chunk", f"must be a positive integer, got {blocks_per_chunk!r}"
            )
        return blocks_per_chunk * self.block_bytes


@dataclass(frozen=True, eq=False)
class _PageView:
    """One page view: page ``b`` starts at ``offset + b * block_stride`` (bytes)."""

    storage: torch.UntypedStorage
    offset: int
    block_stride: int
    page_bytes: int


def register_kv_caches(kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> KVLayout:
    """Derive the :class:`KVLayout` of ``kv_caches`` (layer name -> KV tensor).

    Mutates nothing and copies nothing. Raises :class:`ConfigError` naming the
    offending layer when a tensor does not follow the rule in the module docstring,
    when tensors are on different devices, or when ``kv_caches`` is empty.
    """
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
        raise ConfigError("num_blocks", f"must be a positive integer, got {num_blocks!r}")
    if not kv_caches:
        raise ConfigError("kv_caches", "needs at least one layer tensor, got none")
    devices = {t.device for t in kv_caches.values() if isinstance(t, torch.Tensor)}
    if len(devices) > 1:
        raise ConfigError(
            "kv_caches", f"all layers must be on one device, got {sorted(map(str, devices))}"
        )
    views: list[_PageView] = []
    lines = [LAYOUT_FORMAT, f"layers={len(kv_caches)}"]
    seen: dict[tuple[object, ...], int] = {}
    unique = 0
    for index, (name, tensor) in enumerate(kv_caches.items()):
        identity = _identity(tensor)
        if identity is not None and identity in seen:
            lines.append(f"alias={seen[identity]}")
            continue
        if identity is not None:
            seen[identity] = index
        layer_views, line = _layer_views(name, tensor, num_blocks)
        views.extend(layer_views)
        lines.append(line)
        unique += 1
    word = _word_dtype(views)
    groups = _merge_groups(views, word, num_blocks)
    return KVLayout(
        num_blocks=num_blocks,
        word=word,
        groups=groups,
        block_words=sum(g.record_words for g in groups),
        num_layers=unique,
        description="\n".join(lines),
    )


def _identity(t: object) -> tuple[object, ...] | None:
    """What makes two layer tensors the same memory (None: not a tensor; the view
    check reports it)."""
    if not isinstance(t, torch.Tensor):
        return None
    return (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride(), t.dtype)


def _layer_views(name: str, t: torch.Tensor, num_blocks: int) -> tuple[list[_PageView], str]:
    """The page views of one layer tensor and its digest line."""
    where = f"kv_caches[{name!r}]"
    if not isinstance(t, torch.Tensor):
        raise ConfigError(where, f"must be a torch.Tensor, got {type(t).__name__}")
    shape, strides = tuple(t.shape), t.stride()
    bdim = next((d for d, size in enumerate(shape) if size == num_blocks), None)
    if bdim is None:
        raise ConfigError(where, f"shape {shape} has no dimension of size num_blocks={num_blocks}")
    expected = 1
    for size, stride in reversed(list(zip(shape[bdim + 1 :], strides[bdim + 1 :], strict=True))):
        if size != 1 and stride != expected:
            raise ConfigError(
                where,
                f"dimensions after the block dimension {bdim} must be contiguous; "
                f"shape {shape}, strides {strides}",
            )
        expected *= size
    itemsize = t.element_size()
    page_bytes = math.prod(shape[bdim + 1 :]) * itemsize
    block_stride = strides[bdim] * itemsize
    if page_bytes == 0:
        raise ConfigError(where, f"shape {shape} gives empty pages")
    if num_blocks > 1 and block_stride < page_bytes:
        raise ConfigError(
            where,
            f"pages of consecutive blocks overlap: block stride {block_stride} B "
            f"< page {page_bytes} B",
        )
    storage = t.untyped_storage()
    views = []
    for index in itertools.product(*(range(size) for size in shape[:bdim])):
        elem = int(t.storage_offset()) + sum(i * s for i, s in zip(index, strides, strict=False))
        views.append(_PageView(storage, elem * itemsize, block_stride, page_bytes))
    dims = ",".join("*" if d == bdim else str(size) for d, size in enumerate(shape))
    line = f"dtype={str(t.dtype).removeprefix('torch.')} shape=[{dims}] page_bytes={page_bytes}"
    return views, line


def _word_dtype(views: list[_PageView]) -> torch.dtype:
    """The widest integer dtype dividing every page, stride, offset and base address."""
    for dtype in _WORD_DTYPES:
        w = dtype.itemsize
        if all(
            v.page_bytes % w == 0
            and v.block_stride % w == 0
            and v.offset % w == 0
            and v.storage.data_ptr() % w == 0
            for v in views
        ):
            return dtype
    raise AssertionError("uint8 divides everything")


def _merge_groups(
    views: list[_PageView], word: torch.dtype, num_blocks: int
) -> tuple[PageGroup, ...]:
    """Merge runs of compatible consecutive views; build one strided tensor per run."""
    runs: list[tuple[list[_PageView], int]] = []  # (views, step in bytes)
    for view in views:
        if runs and _extends(runs[-1], view, num_blocks):
            group, step = runs[-1]
            runs[-1] = ([*group, view], step or view.offset - group[0].offset)
        else:
            runs.append(([view], 0))
    groups, record_offset = [], 0
    w = word.itemsize
    for group, step in runs:
        first = group[0]
        flat = torch.empty(0, dtype=torch.uint8, device=first.storage.device).set_(first.storage)
        usable = flat.numel() - flat.numel() % w
        words = flat[:usable].view(word)
        page_words = first.page_bytes // w
        pages = words.as_strided(
            (num_blocks, len(group), page_words),
            (first.block_stride // w, (step or first.page_bytes) // w, 1),
            first.offset // w,
        )
        groups.append(PageGroup(pages=pages, record_offset=record_offset))
        record_offset += len(group) * page_words
    return tuple(groups)


def _extends(run: tuple[list[_PageView], int], view: _PageView, num_blocks: int) -> bool:
    """Whether ``view`` continues ``run`` as one non-overlapping strided view."""
    group, step = run
    first, last = group[0], group[-1]
    if (
        view.storage.data_ptr() != first.storage.data_ptr()
        or view.storage.device != first.storage.device
        or view.page_bytes != first.page_bytes
        or view.block_stride != first.block_stride
    ):
        return False
    new_step = view.offset - last.offset
    if new_step <= 0 or (step and new_step != step):
        return False
    return _non_overlapping(
        first.page_bytes, [(first.block_stride, num_blocks), (new_step, len(group) + 1)]
    )


def _non_overlapping(page_bytes: int, dims: list[tuple[int, int]]) -> bool:
    """Sufficient test that pages at ``sum(i_d * stride_d)`` never overlap."""
    extent = page_bytes
    for stride, size in sorted((s, n) for s, n in dims if n > 1):
        if stride < extent:
            return False
        extent += stride * (size - 1)
    return True
