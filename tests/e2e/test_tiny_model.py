"""The random Llama checkpoints: written once, complete, reloadable, reused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvoffload.demos.tiny_model import (
    PRESETS,
    ensure_model,
    is_complete,
    model_dir,
    parameter_count,
)


@pytest.fixture(scope="session")
def models_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


def test_tiny_is_written_complete_and_reloads(models_root: Path) -> None:
    path = ensure_model("tiny", models_root)
    assert path == model_dir("tiny", models_root)
    assert is_complete(path, PRESETS["tiny"])
    assert (path / "model.safetensors").is_file()
    config = json.loads((path / "config.json").read_text())
    assert config["num_hidden_layers"] == 2
    assert config["hidden_size"] == 128
    assert config["dtype"] == "float32"

    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM.from_pretrained(path)
    assert sum(p.numel() for p in model.parameters()) == parameter_count("tiny")
    # No temporary directories are left next to the model.
    assert [p.name for p in models_root.iterdir()] == ["tiny"]


def test_ensure_model_is_idempotent(models_root: Path) -> None:
    first = ensure_model("tiny", models_root)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again = ensure_model("tiny", models_root)
    assert again == first
    assert (again / "model.safetensors").stat().st_mtime_ns == stamp


def test_same_seed_same_weights(tmp_path: Path, models_root: Path) -> None:
    first = ensure_model("tiny", models_root)
    second = ensure_model("tiny", tmp_path)
    assert (first / "model.safetensors").read_bytes() == (second / "model.safetensors").read_bytes()


def test_incomplete_directory_is_replaced(tmp_path: Path) -> None:
    stale = model_dir("tiny", tmp_path)
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{}")  # a crash left this; no marker
    path = ensure_model("tiny", tmp_path)
    assert is_complete(path, PRESETS["tiny"])
    assert (path / "model.safetensors").is_file()


def test_unknown_preset_names_accepted_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="demo"):
        ensure_model("huge", tmp_path)


def test_demo_preset_is_about_100m_parameters() -> None:
    assert 80e6 <= parameter_count("demo") <= 130e6
