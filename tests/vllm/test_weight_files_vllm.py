"""The files the weights digest reads are the ones vLLM's default loader picks
(``core/identity/weight_files.py`` mirrors ``DefaultModelLoader._prepare_weights``):
checked against the installed vLLM on checkpoint layouts with files beside the weights,
for every load format of that loader. No engine is built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvoffload.core.identity.weight_files import DEFAULT_LOADER_FORMATS, loaded_files

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
EXTRAS = ("pytorch_model.bin", "optimizer.pt", "training_args.bin", "tf_model.h5", "config.json")
LAYOUTS: dict[str, tuple[tuple[str, ...], dict[str, tuple[str, ...]]]] = {
    # name: (files, {index file: the names its weight_map holds})
    "shards-indexed": (
        (*SHARDS, "model.safetensors", *EXTRAS),
        {"model.safetensors.index.json": SHARDS},
    ),
    "shards": ((*SHARDS, *EXTRAS), {}),
    "bin": (EXTRAS, {}),
    "pt": (("model.pt", "optimizer.pt", "scheduler.pt"), {}),
    "trainer-only": (("training_args.bin", "optimizer.pt"), {}),
    "mistral": (("consolidated.safetensors", *SHARDS, "params.json"), {}),
    "mistral-indexed": (
        ("consolidated-00001.safetensors", "consolidated-00002.safetensors", *SHARDS),
        {
            "consolidated.safetensors.index.json": ("consolidated-00001.safetensors",),
            "model.safetensors.index.json": SHARDS,
        },
    ),
}


def vllm_choice(directory: Path, load_format: str) -> list[str]:
    """The file names vLLM's loader reads (empty where it refuses the directory)."""
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    loader = DefaultModelLoader(LoadConfig(load_format=load_format))
    try:
        _, files, _, _ = loader._prepare_weights(str(directory), None, None, True, None)
    except RuntimeError:  # "Cannot find any model weights"
        return []
    return sorted(Path(f).name for f in files)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_digested_files_are_the_ones_vllm_loads(layout: str, tmp_path: Path) -> None:
    files, indexes = LAYOUTS[layout]
    for name in files:
        (tmp_path / name).write_bytes(b"x")
    for index, names in indexes.items():
        weight_map = {f"w{i}": name for i, name in enumerate(names)}
        (tmp_path / index).write_text(json.dumps({"weight_map": weight_map}))
    for load_format in sorted(DEFAULT_LOADER_FORMATS):
        ours = [p.name for p in loaded_files(tmp_path, load_format)]
        assert ours == vllm_choice(tmp_path, load_format), (layout, load_format)
