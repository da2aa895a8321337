"""The weights digest reads only the files vLLM's default loader loads
(``core/identity/weight_files.py``): the safetensors files (those the index names),
else the ``*.bin`` or ``*.pt`` files without a trainer's leftovers; never a
``pytorch_model.bin``, ``tf_model.h5`` or optimizer state beside them. Which files
are digested is observed on ``content_digest.hash_file`` (every full read goes
through it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvoffload.core.identity import content_digest
from kvoffload.core.identity.content_digest import DigestCache
from kvoffload.core.identity.model import weights_digest
from kvoffload.core.identity.weight_files import config_files, loaded_files

EXTRAS = ("pytorch_model.bin", "optimizer.pt", "training_args.bin", "tf_model.h5", "config.json")
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def make(root: Path, *names: str, index: tuple[str, ...] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name in names:
        (root / name).write_bytes(name.encode() * 10)
    if index is not None:
        weight_map = {f"layer{i}.weight": name for i, name in enumerate(index)}
        (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return root


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the files read in full, in any order."""
    seen: list[str] = []
    real = content_digest.hash_file

    def counted(path: Path) -> str:
        seen.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(content_digest, "hash_file", counted)
    return seen


def digest(root: Path, tmp_path: Path, **kwargs: object) -> str:
    """The digest with a fresh cache (nothing remembered: every chosen file is read)."""
    cache = DigestCache(tmp_path / f"cache-{len(list(tmp_path.iterdir()))}")
    return weights_digest(root, cache, **kwargs)  # type: ignore[arg-type]


def test_only_the_safetensors_files_the_index_names_are_read(
    tmp_path: Path, reads: list[str]
) -> None:
    root = make(tmp_path / "m", *SHARDS, "model.safetensors", *EXTRAS, index=SHARDS)
    digest(root, tmp_path)
    assert sorted(reads) == list(SHARDS)  # not the stray consolidated copy, not the extras


def test_every_safetensors_file_without_an_index(tmp_path: Path, reads: list[str]) -> None:
    root = make(tmp_path / "m", *SHARDS, *EXTRAS)
    digest(root, tmp_path)
    assert sorted(reads) == list(SHARDS)


def test_bin_files_without_safetensors_and_never_a_trainers_state(
    tmp_path: Path, reads: list[str]
) -> None:
    root = make(tmp_path / "m", *EXTRAS, "optimizer.bin", "scheduler.pt", "scaler.pt")
    digest(root, tmp_path)
    assert reads == ["pytorch_model.bin"]


def test_pt_files_when_there_is_nothing_else(tmp_path: Path, reads: list[str]) -> None:
    root = make(tmp_path / "m", "model.pt", "optimizer.pt", "tf_model.h5")
    digest(root, tmp_path)
    assert reads == ["model.pt"]


def test_files_outside_the_chosen_ones_do_not_change_the_digest(tmp_path: Path) -> None:
    root = make(tmp_path / "m", *SHARDS, *EXTRAS, index=SHARDS)
    before = digest(root, tmp_path)
    for name in EXTRAS:
        (root / name).write_bytes(b"rewritten")  # what vLLM never loads
    (root / "extra.safetensors").write_bytes(b"not in the index")
    assert digest(root, tmp_path) == before
    (root / SHARDS[1]).write_bytes(b"rewritten")
    assert digest(root, tmp_path) != before


def test_a_mistral_checkpoint_is_read_from_its_consolidated_files(tmp_path: Path) -> None:
    root = make(tmp_path / "m", "consolidated.safetensors", *SHARDS, "params.json")
    assert [p.name for p in loaded_files(root)] == ["consolidated.safetensors"]
    assert [p.name for p in loaded_files(root, "safetensors")] == [
        "consolidated.safetensors",
        *SHARDS,
    ]


@pytest.mark.parametrize(
    ("load_format", "expected"),
    [
        ("safetensors", []),  # safetensors only: vLLM refuses to load this directory
        ("pt", ["model.pt"]),
        ("npcache", ["pytorch_model.bin"]),
        ("HF", ["pytorch_model.bin"]),  # vLLM lowercases the format
        ("sharded_state", ["model.pt", "pytorch_model.bin", "tf_model.h5", "training_args.bin"]),
        ("dummy", ["model.pt", "pytorch_model.bin", "tf_model.h5", "training_args.bin"]),
    ],
)
def test_each_load_format(tmp_path: Path, load_format: str, expected: list[str]) -> None:
    """The formats of vLLM's default loader are mirrored; the others (their loaders
    read files kvoffload does not model) keep every file with a weight suffix."""
    root = make(tmp_path / "m", "pytorch_model.bin", "model.pt", "training_args.bin")
    make(root, "tf_model.h5", "config.json")
    assert [p.name for p in loaded_files(root, load_format)] == expected


def test_hidden_files_directories_and_a_bad_index_are_handled_like_vllm(tmp_path: Path) -> None:
    root = make(tmp_path / "m", *SHARDS, ".partial.safetensors")
    (root / "dir.safetensors").mkdir()
    (root / "model.safetensors.index.json").write_text("{not json")  # vLLM fails; no filter
    assert [p.name for p in loaded_files(root)] == list(SHARDS)


def test_a_quantization_methods_own_config_file_is_digested(
    tmp_path: Path, reads: list[str]
) -> None:
    root = make(tmp_path / "m", "model.safetensors", "quantize_config.json", "config.json")
    assert [p.name for p in config_files(root, ["quantize_config.json"])] == [
        "quantize_config.json"
    ]
    before = digest(root, tmp_path, config=("quantize_config.json",))
    assert sorted(reads) == ["model.safetensors", "quantize_config.json"]
    (root / "quantize_config.json").write_text('{"bits": 3}')
    assert digest(root, tmp_path, config=("quantize_config.json",)) != before
    reads.clear()
    digest(root, tmp_path)  # a model whose quantization names no such file
    assert reads == ["model.safetensors"]
