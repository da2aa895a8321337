"""A restart with a changed model configuration never reads the old KV (decision
0010), in a real in-process vLLM engine (float32, tiny Llama, disk tier).

Engine 1 fills the disk tier. Engine 2, on the same disk, overrides the model's
``rms_norm_eps`` (the same KV layout, other KV values): it must find nothing and
answer as an engine without kvoffload and with the same override. Engine 3, the
original configuration again, is served from the disk and answers as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from llm_support import (
    PROMPTS,
    counted,
    disk_config,
    engine,
    generate,
    half,
    settle,
    tier,
    tokens,
)

from kvoffload.core.keys import Namespace
from kvoffload.tiers.disk_record import read_disk_record

OVERRIDE = {"rms_norm_eps": 1.0}
CHUNKS = 2 * 8  # two prompts of 8 chunks each


def namespace(llm: Any) -> Namespace:
    """The namespace the engine's scheduler half keys chunks with."""
    ns = half(llm).namespace
    assert isinstance(ns, Namespace)
    return ns


def disk_hits(llm: Any) -> int:
    return int(tier(llm, "disk").metrics.value("hit_tokens_total"))


def test_a_changed_model_config_starts_with_an_empty_namespace(
    tiny_model: Path, tmp_path: Path
) -> None:
    prompts = PROMPTS[:2]
    with engine(tiny_model, None, hf_overrides=OVERRIDE) as llm:
        overridden = tokens(generate(llm, prompts))
    with engine(tiny_model, disk_config(tmp_path)) as llm:
        outputs = generate(llm, prompts)
        original = tokens(outputs)  # computed from scratch: nothing was stored yet
        assert [o.num_cached_tokens for o in outputs] == [0, 0]
        settle(llm)
        assert counted(llm, "transferred_chunks_total", direction="spill", tier="disk") == CHUNKS
        first = namespace(llm)
    assert overridden != original  # the override changes the answer: the test means something
    with engine(tiny_model, disk_config(tmp_path), hf_overrides=OVERRIDE) as llm:
        assert tier(llm, "disk").held_count() == 0
        outputs = generate(llm, prompts)
        assert [o.num_cached_tokens for o in outputs] == [0, 0]
        assert tokens(outputs) == overridden
        assert disk_hits(llm) == 0
        settle(llm)
        second = namespace(llm)
    assert second.config != first.config and second.weights == first.weights
    records = {
        path.name: read_disk_record(path, path.name)
        for path in (tmp_path / "disk" / "kvoffload-v1").iterdir()
    }
    assert records == {
        first.digest().hex(): first.fields(),
        second.digest().hex(): second.fields(),
    }
    with engine(tiny_model, disk_config(tmp_path)) as llm:  # the original again
        assert tier(llm, "disk").held_count() == CHUNKS
        outputs = generate(llm, prompts)
        assert [o.num_cached_tokens for o in outputs] == [len(p) for p in prompts]
        assert tokens(outputs) == original
        assert disk_hits(llm) == sum(len(p) for p in prompts)
        settle(llm)
