"""A worker's live fingerprint of the model vLLM built (decision 0019): found from
the caller that registers the KV caches, it follows every parameter, the rotary
embeddings' choices and what passes through ``load_weights``."""

from __future__ import annotations

from typing import Any

import torch

from kvoffload.adapters.vllm.live_identity import UNIDENTIFIED, LiveWeights, rotary_choices


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.register_buffer("cache", torch.arange(4.0), persistent=False)
        self.loaded: list[str] = []

    def load_weights(self, weights: Any) -> set[str]:
        for name, tensor in weights:
            self.get_parameter(name).data.copy_(tensor)
            self.loaded.append(name)
        return set(self.loaded)


class Runner:
    """Stands in for vLLM's model runner: it registers the KV caches."""

    def __init__(self) -> None:
        self.model = Tiny()

    def get_model(self) -> torch.nn.Module:
        return self.model

    def register(self) -> LiveWeights | None:
        return LiveWeights.find()


def test_the_model_is_found_from_the_caller_that_registers_the_kv_caches() -> None:
    runner = Runner()
    live = runner.register()
    assert live is not None and live.model() is runner.model
    assert LiveWeights.find() is None  # no runner up this stack


def test_an_in_place_change_of_a_parameter_changes_the_fingerprint_a_buffer_not() -> None:
    runner = Runner()
    live = runner.register()
    assert live is not None
    first = live.fingerprint()
    assert live.fingerprint() == first != UNIDENTIFIED
    runner.model.cache.mul_(2)  # a non-persistent buffer: computed, not loaded
    assert live.fingerprint() == first
    with torch.no_grad():
        runner.model.proj.weight.mul_(3)
    assert live.fingerprint() != first


def test_what_passes_through_load_weights_marks_it_dirty_and_is_fingerprinted() -> None:
    runner = Runner()
    live = runner.register()
    assert live is not None
    first = live.fingerprint()
    assert not live.dirty
    new = torch.ones(4, 4)
    runner.model.load_weights([("proj.weight", new)])  # the wrapped method
    assert runner.model.loaded == ["proj.weight"] and live.dirty
    second = live.fingerprint()
    assert second != first and not live.dirty
    runner.model.load_weights([("proj.weight", new * 2)])
    assert live.fingerprint() != second


def test_the_choices_of_vllm_rotary_embeddings_are_read(tiny_longrope_model: Any) -> None:
    """LongRoPE's short or long factors, chosen from ``max_model_len`` when vLLM
    builds it, are part of the fingerprint."""
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.phi3_long_rope_scaled_rope import (
        Phi3LongRoPEScaledRotaryEmbedding,
    )

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rope = Phi3LongRoPEScaledRotaryEmbedding(
                32, 32, 4096, 256, 10000.0, True, torch.float32, [1.0] * 16, [2.0] * 16
            )

    built = {}
    for max_model_len in (256, 1024):
        config = VllmConfig(
            model_config=ModelConfig(
                str(tiny_longrope_model), max_model_len=max_model_len, skip_tokenizer_init=True
            )
        )
        with set_current_vllm_config(config):
            built[max_model_len] = rotary_choices(Model())
    assert built[256] != built[1024]
    assert "use_long_rope" in str(built[1024])


def test_weights_that_cannot_be_fingerprinted_never_fail_the_worker() -> None:
    from kvoffload.adapters.vllm.worker_weights import WorkerWeights
    from kvoffload.core.identity.weights import WeightsStamp

    weights = WorkerWeights()

    def broken() -> bytes:
        raise RuntimeError("an unreadable model")

    weights.source = broken
    weights.open(0)
    assert weights.fingerprint == UNIDENTIFIED
    assert weights.take_reports() == ((0, 0, UNIDENTIFIED),)
    assert weights.admits(WeightsStamp(1, (UNIDENTIFIED,)))  # checks go on, constant
