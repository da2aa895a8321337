"""Fake engine KV caches in every layout the transfer worker accepts, and their check.

Each layout is one the layout rule of :mod:`kvoffload.transfer.layout` admits and an
engine really builds:

- ``vllm_cpu``: per layer ``[N, heads, block, 2 * dim]``, all layers views of one storage;
- ``flash_attn``: per layer ``[2, N, block, heads, dim]`` (K and V pages), vLLM's GPU layout;
- ``flashinfer``: per layer ``[N, 2, block, heads, dim]`` (block first);
- ``cross_layer``: one tensor ``[N, layers, 2, block, heads, dim]``;
- ``mla``: per layer ``[N, block, dim]`` (one latent page, no K/V split);
- ``aliased``: ``flash_attn`` where every second layer is the previous layer's tensor
  (a hybrid model's KV cache groups, or KV sharing);
- ``padded``: per layer ``[N, 2, block, heads, dim]`` viewed out of rows padded past
  the page (block stride larger than the page, as hybrid models pad pages);
- ``odd_pages``: two layers of 3 and 5 elements per block (narrow copy words, two
  page groups of different page sizes).

The check (:func:`expected_after_load`, :func:`block_record`) follows the layout rule
directly, with no code of :mod:`kvoffload.transfer`, so a round trip is compared with
the rule, not with itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVShape:
    """The geometry of a fake engine: ``num_blocks`` blocks of ``block_size`` tokens."""

    num_blocks: int
    block_size: int
    dtype: torch.dtype = torch.bfloat16
    device: str = "cpu"
    layers: int = 2
    heads: int = 2
    head_dim: int = 64


@dataclass(frozen=True, eq=False)
class KVCaches:
    """Layer name -> KV tensor, with each layer's block dimension.

    The tensors are owned here (a layout only views them); their bytes are random.
    """

    layout: str
    caches: dict[str, torch.Tensor]
    block_dims: dict[str, int]
    num_blocks: int


def _vllm_cpu(s: KVShape) -> tuple[dict[str, torch.Tensor], int]:
    shape = (s.num_blocks, s.heads, s.block_size, 2 * s.head_dim)
    per_layer = s.num_blocks * s.heads * s.block_size * 2 * s.head_dim
    raw = torch.empty(s.layers * per_layer, dtype=s.dtype, device=s.device)
    views = {
        f"layers.{i}": raw[i * per_layer : (i + 1) * per_layer].view(shape) for i in range(s.layers)
    }
    return views, 0


def _flash_attn(s: KVShape) -> tuple[dict[str, torch.Tensor], int]:
    shape = (2, s.num_blocks, s.block_size, s.heads, s.head_dim)
    return {f"layers.{i}": _empty(s, shape) for i in range(s.layers)}, 1


def _flashinfer(s: KVShape) -> tuple[dict[str, torch.Tensor], int]:
    shape = (s.num_blocks, 2, s.block_size, s.heads, s.head_dim)
    return {f"layers.{i}": _empty(s, shape) for i in range(s.layers)}, 0


def _cross_layer(s: KVShape) -> tuple[dict[str, torch.Tensor], int]:
    shape = (s.num_blocks, s.layers, 2, s.block_size, s.heads, s.head_dim)
    return {"all": _empty(s, shape)}, 0


def _mla(s: KVShape) -> tuple[dict[str, torch.Tensor], int]:
    shape = (s.num_blocks, s.block_size, s.heads * s.head_dim)
    return {f"layers.{i}": _empty(s, shape) for i in range(s.layers)}, 0


def _aliased(s: KVShape) -> tuple[dict[str, torch.Tensor], int]:
    caches, bdim = _flash_attn(s)
    names = list(caches)
    for i in range(1, len(names), 2):
        caches[names[i]] = caches[names[i - 1]]
    return caches, bdim


def _padded(s: KVShape) -> tuple[dict[str, torch.Tensor], int]:
    page = 2 * s.block_size * s.heads * s.head_dim
    rows = [_empty(s, (s.num_blocks, page + 64)) for _ in range(s.layers)]
    shape = (s.num_blocks, 2, s.block_size, s.heads, s.head_dim)
    return {f"layers.{i}": r[:, :page].view(shape) for i, r in enumerate(rows)}, 0


def _odd_pages(s: KVShape) -> tuple[dict[str, torch.Tensor], int]:
    return {"a": _empty(s, (s.num_blocks, 3)), "b": _empty(s, (s.num_blocks, 5))}, 0


def _empty(s: KVShape, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.empty(shape, dtype=s.dtype, device=s.device)


BUILDERS: dict[str, Callable[[KVShape], tuple[dict[str, torch.Tensor], int]]] = {
    "vllm_cpu": _vllm_cpu,
    "flash_attn": _flash_attn,
    "flashinfer": _flashinfer,
    "cross_layer": _cross_layer,
    "mla": _mla,
    "aliased": _aliased,
    "padded": _padded,
    "odd_pages": _odd_pages,
}
LAYOUTS = tuple(BUILDERS)


def build(layout: str, shape: KVShape, *, seed: int = 0) -> KVCaches:
    """Fresh caches of ``layout`` (one of :data:`LAYOUTS`) with random bytes."""
    caches, bdim = BUILDERS[layout](shape)
    torch.manual_seed(seed)
    for t in caches.values():
        as_bytes(t).random_(0, 256)
    return KVCaches(layout, caches, dict.fromkeys(caches, bdim), shape.num_blocks)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as uint8 (its last dimension is contiguous in every layout here)."""
    return t.view(torch.uint8)


def snapshot(kv: KVCaches) -> dict[str, torch.Tensor]:
    """A byte copy of every layer (on the caches' device)."""
    return {name: as_bytes(t).clone() for name, t in kv.caches.items()}


def expected_after_load(
    kv: KVCaches, before: dict[str, torch.Tensor], moves: list[tuple[int, int]]
) -> dict[str, torch.Tensor]:
    """Every layer's bytes once block ``src`` was copied to block ``dst`` for each
    ``(src, dst)`` of ``moves`` (sources and destinations disjoint), the rest as in
    ``before``."""
    device = next(iter(before.values())).device
    src = torch.tensor([m[0] for m in moves], dtype=torch.int64, device=device)
    dst = torch.tensor([m[1] for m in moves], dtype=torch.int64, device=device)
    out = {}
    for name, old in before.items():
        bdim = kv.block_dims[name]
        out[name] = old.clone().index_copy_(bdim, dst, old.index_select(bdim, src))
    return out


def mismatched_layers(kv: KVCaches, expected: dict[str, torch.Tensor]) -> list[str]:
    """Names of the layers whose bytes differ from ``expected``."""
    return [name for name, t in kv.caches.items() if not torch.equal(as_bytes(t), expected[name])]


def block_record(kv: KVCaches, block: int) -> bytes:
    """The reference bytes of one block record: every page view's page of ``block``,
    layer by layer (a layer aliasing an earlier one adds nothing), then in the order
    of the dimensions before the block dimension."""
    seen: set[tuple[object, ...]] = set()
    pages = []
    for name, t in kv.caches.items():
        identity = (t.data_ptr(), t.shape, t.stride(), t.dtype)
        if identity in seen:
            continue
        seen.add(identity)
        bdim = kv.block_dims[name]
        for index in itertools.product(*(range(size) for size in t.shape[:bdim])):
            page = t[index][block] if index else t[block]
            pages.append(as_bytes(page.contiguous()).flatten())
    return bytes(torch.cat(pages).cpu().numpy().tobytes())
