"""Layout registration: page groups, word dtype, digest, and rejected layouts."""

from __future__ import annotations

import pytest
import torch
from kv_engines import cross_layer, gpu_style, odd_pages, vllm_cpu

from kvoffload.core.errors import ConfigError
from kvoffload.transfer import register_kv_caches


def test_vllm_cpu_layers_merge_into_one_strided_group() -> None:
    engine = vllm_cpu(10, layers=4)
    layout = register_kv_caches(engine.caches, 10)
    assert len(layout.groups) == 1
    (group,) = layout.groups
    assert layout.word == torch.int64
    assert group.pages.shape == (10, 4, 2 * 4 * 16 * 2 // 8)
    assert layout.block_bytes == 4 * 256
    first = engine.caches["model.layers.0.attn"]
    assert group.pages.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()


def test_gpu_style_gives_k_and_v_pages_per_layer() -> None:
    layout = register_kv_caches(gpu_style(10, layers=3).caches, 10)
    assert [g.views for g in layout.groups] == [2, 2, 2]
    assert [g.record_offset for g in layout.groups] == [0, 32, 64]  # 2 pages of 16 words
    assert layout.block_bytes == 3 * 2 * 4 * 2 * 8 * 2


def test_one_shared_gpu_style_tensor_merges_all_layers() -> None:
    raw = torch.zeros(3, 2, 10, 4, 2, 8, dtype=torch.float16)
    layout = register_kv_caches({f"l{i}": raw[i] for i in range(3)}, 10)
    assert [g.views for g in layout.groups] == [6]


def test_cross_layer_tensor_is_one_page_per_block() -> None:
    layout = register_kv_caches(cross_layer(10, layers=3).caches, 10)
    assert [(g.views, g.page_words) for g in layout.groups] == [(1, 3 * 2 * 4 * 2 * 8 * 2 // 8)]


def test_word_is_the_widest_integer_dividing_the_pages() -> None:
    layout = register_kv_caches(odd_pages(10).caches, 10)
    assert layout.word == torch.int16
    assert [g.page_words for g in layout.groups] == [3, 5]
    odd_offset = torch.zeros(31, dtype=torch.uint8)[1:].view(10, 3)
    assert register_kv_caches({"x": odd_offset}, 10).word == torch.uint8


def test_registration_copies_nothing() -> None:
    engine = vllm_cpu(6)
    layout = register_kv_caches(engine.caches, 6)
    layout.groups[0].pages[2, 1].fill_(0x0101010101010101)
    page = engine.caches["model.layers.1.attn"][2]
    assert bool((page.view(torch.uint8) == 1).all())


def digest(caches: dict[str, torch.Tensor], num_blocks: int) -> str:
    return register_kv_caches(caches, num_blocks).digest


def test_digest_is_equal_for_equal_layouts_and_ignores_placement() -> None:
    a = digest(vllm_cpu(10).caches, 10)
    assert a == digest(vllm_cpu(10).caches, 10)
    assert a == digest(vllm_cpu(20).caches, 20), "num_blocks is not part of the format"
    separate = {f"l{i}": torch.zeros(10, 2, 4, 16, dtype=torch.bfloat16) for i in range(3)}
    assert a == digest(separate, 10), "shared or separate storage: same bytes"
    assert len(a) == 32 and int(a, 16) >= 0


def test_digest_differs_when_shape_dtype_or_layer_count_differ() -> None:
    base = digest(vllm_cpu(10).caches, 10)
    assert base != digest(vllm_cpu(10, dtype=torch.float16).caches, 10)
    assert base != digest(vllm_cpu(10, layers=2).caches, 10)
    reshaped = {f"l{i}": torch.zeros(10, 4, 2, 16, dtype=torch.bfloat16) for i in range(3)}
    assert base != digest(reshaped, 10), "same page bytes, other shape"
    assert digest(gpu_style(10).caches, 10) != digest(cross_layer(10).caches, 10)


@pytest.mark.parametrize(
    ("caches", "num_blocks", "field", "words"),
    [
        ({}, 4, "kv_caches", "at least one layer"),
        ({"x": torch.zeros(4, 8)}, 0, "num_blocks", "positive"),
        ({"x": torch.zeros(5, 8)}, 4, "kv_caches['x']", "no dimension of size num_blocks=4"),
        ({"x": torch.zeros(8, 4).t()}, 4, "kv_caches['x']", "must be contiguous"),
        ({"x": torch.zeros(4, 3, 2)[:, :, :1]}, 4, "kv_caches['x']", "must be contiguous"),
        ({"x": torch.zeros(8).as_strided((4, 4), (1, 1))}, 4, "kv_caches['x']", "overlap"),
        ({"x": torch.zeros(4, 8), "y": torch.zeros(4, 8, device="meta")}, 4, "kv_caches", "device"),
        ({"x": [1, 2]}, 4, "kv_caches['x']", "torch.Tensor"),
    ],
)
def test_unsupported_layouts_are_config_errors(
    caches: dict[str, torch.Tensor], num_blocks: int, field: str, words: str
) -> None:
    with pytest.raises(ConfigError, match=words) as info:
        register_kv_caches(caches, num_blocks)
    assert info.value.field == field


def test_layers_aliasing_one_tensor_add_no_pages() -> None:
    """vLLM's hybrid KV cache manager gives one layer of every KV cache group the
    same tensor: its blocks are registered once, and the digest names the aliases."""
    engine = vllm_cpu(10, layers=2)
    first, second = engine.caches.values()
    hybrid = {"g0.l0": first, "g1.l0": first, "g0.l1": second, "g1.l1": second}
    layout = register_kv_caches(hybrid, 10)
    plain = register_kv_caches(engine.caches, 10)
    assert layout.num_layers == 2
    assert layout.block_bytes == plain.block_bytes
    assert "alias=0" in layout.description and "alias=2" in layout.description
    assert layout.digest != plain.digest
