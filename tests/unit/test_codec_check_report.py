"""What ``kvoffload codec-check`` prints (``codec_check_report.py``): identical answers
as N/M, where differing answers first differ, the model and sample measured on, and
random weights named as such; the comparison on hand-made answers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvoffload.codec_check_report import Answer, Sample, compare, describe_model


def test_first_differences_are_counted_from_one_and_printed_with_identical_n_of_m() -> None:
    before = [Answer((1, 2, 3, 4), (-0.1,) * 4), Answer((5, 6, 7, 8), (-1.0,) * 4),
              Answer((9, 9, 9, 9), (-0.5,) * 4), Answer((1, 1), (-0.2,) * 2)]  # fmt: skip
    after = [Answer((1, 2, 3, 4), (-0.1,) * 4), Answer((5, 6, 0, 0), (-1.0,) * 4),
             Answer((0, 9, 9, 9), (-0.5,) * 4), Answer((1, 1, 1), (-0.2,) * 3)]  # fmt: skip
    report = compare("fp8", before, after, 640)
    assert report.identical_requests == 1 and report.requests == 4
    assert report.first_differences == (3, 1, 3)  # 3rd token; 1st; one answer longer
    assert report.max_tokens == 4
    text = report.text()
    assert "identical answers: 1/4" in text
    assert "first differing token, in the 3 answers that differ: min 1, median 3, max 3" in text
    exact = compare("none", before, before, 640)
    assert exact.first_differences == () and "first differing" not in exact.text()


def test_the_sample_names_the_model_and_random_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 128,
        "num_key_value_heads": 2, "vocab_size": 1024,
    }))  # fmt: skip
    architecture, random_weights = describe_model(tmp_path)
    assert architecture == "LlamaForCausalLM, 2 layers, 128 hidden, 2 KV heads, 1024 vocab"
    assert random_weights is None
    (tmp_path / "kvoffload-model.json").write_text(json.dumps({"name": "tiny", "seed": 0}))
    _, random_weights = describe_model(tmp_path)
    assert random_weights == "kvoffload's demo preset 'tiny', seed 0"
    sample = Sample(str(tmp_path), architecture, random_weights, "float32", 48, "512",
                    "random token ids, seed 0", 16)  # fmt: skip
    text = sample.text()
    assert "random weights (kvoffload's demo preset 'tiny'" in text
    assert "48 prompts of 512 tokens" in text and "16 tokens generated greedily" in text
    assert "engine dtype float32" in text
    assert describe_model(tmp_path / "missing") == ("no readable config.json", None)


@pytest.mark.parametrize("bad", ["[]", "{", '{"architectures": null}'])
def test_a_config_without_architectures_still_describes(tmp_path: Path, bad: str) -> None:
    (tmp_path / "config.json").write_text(bad)
    architecture, _ = describe_model(tmp_path)
    assert isinstance(architecture, str) and architecture
