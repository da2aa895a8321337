"""The model identity's digests: canonical configuration data and weight files read
from headers and samples only; deterministic, and never raising."""

from __future__ import annotations

import enum
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.core.keys import Namespace
from kvoffload.core.model_identity import (
    SAMPLE_BYTES,
    canonical,
    digest_of,
    file_identity,
    weights_digest,
)


def write_safetensors(path: Path, shape: list[int], fill: int = 0, meta: str = "a") -> None:
    """A minimal safetensors file: one float32 tensor of ``shape`` filled with ``fill``."""
    count = 1
    for n in shape:
        count *= n
    header = {
        "w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 4 * count]},
        "__metadata__": {"note": meta},
    }
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes([fill]) * (4 * count))


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    root = tmp_path / "model"
    root.mkdir()
    write_safetensors(root / "model-00001.safetensors", [64, 64])
    write_safetensors(root / "model-00002.safetensors", [32])
    (root / "config.json").write_text("{}")  # not a weight file
    return root


class Color(enum.Enum):
    RED = 1


class Plain:
    def __init__(self) -> None:
        self.a = 1
        self._hidden = object()


def test_canonical_data_is_plain_json_without_addresses() -> None:
    data = canonical(
        {"f": 0.5, "nan": float("nan"), "e": Color.RED, "s": {3, 1}, "t": (1, "x"), "o": Plain()}
    )
    assert data == {
        "f": 0.5,
        "nan": "nan",
        "e": "Color.RED",
        "s": [1, 3],
        "t": [1, "x"],
        "o": {"<type>": "Plain", "a": 1},
    }
    assert " at 0x" not in json.dumps(canonical(object()))


def test_digests_ignore_key_order_and_are_the_same_in_another_process() -> None:
    assert digest_of({"a": 1, "b": [1.0, None]}) == digest_of({"b": [1.0, None], "a": 1})
    code = "from kvoffload.core.model_identity import digest_of\nprint(digest_of({'a': 1}))\n"
    env = {"PYTHONHASHSEED": "4242", "PATH": "", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.strip() == digest_of({"a": 1})


def test_an_unchanged_directory_has_the_same_digest(model_dir: Path) -> None:
    assert weights_digest(model_dir) == weights_digest(model_dir)
    (model_dir / "config.json").write_text('{"x": 1}')  # config files are not weights
    assert weights_digest(model_dir) == weights_digest(str(model_dir))


@pytest.mark.parametrize(
    "replace",
    [
        pytest.param(lambda p: write_safetensors(p, [64, 65]), id="another-shape-and-size"),
        pytest.param(lambda p: write_safetensors(p, [64, 64], meta="b"), id="another-header"),
        pytest.param(lambda p: write_safetensors(p, [64, 64], fill=7), id="same-header-new-data"),
        pytest.param(lambda p: p.unlink(), id="a-file-removed"),
    ],
)
def test_a_replaced_weight_file_changes_the_digest(model_dir: Path, replace: object) -> None:
    before = weights_digest(model_dir)
    assert callable(replace)
    replace(model_dir / "model-00001.safetensors")
    assert weights_digest(model_dir) != before


def test_a_new_weight_file_changes_the_digest(model_dir: Path) -> None:
    before = weights_digest(model_dir)
    write_safetensors(model_dir / "model-00003.safetensors", [8])
    assert weights_digest(model_dir) != before


def test_a_change_inside_a_sampled_range_changes_the_digest(model_dir: Path) -> None:
    """The data of a large file is sampled at its start, middle and end."""
    path = model_dir / "model-00001.safetensors"
    write_safetensors(path, [SAMPLE_BYTES, 2])  # 512 KiB of data, 3 samples of 64 KiB
    before = weights_digest(model_dir)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert weights_digest(model_dir) != before


def test_other_weight_files_are_named_sized_and_timed(model_dir: Path) -> None:
    pt = model_dir / "pytorch_model.bin"
    pt.write_bytes(b"x" * 100)
    os.utime(pt, ns=(1_000_000_000, 1_000_000_000))
    before = weights_digest(model_dir)
    assert file_identity(pt) == ["pytorch_model.bin", 100, 1_000_000_000]
    os.utime(pt, ns=(2_000_000_000, 2_000_000_000))  # replaced by a file of the same size
    assert weights_digest(model_dir) != before


def test_a_single_weight_file_is_its_own_identity(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    assert weights_digest(gguf) == digest_of([file_identity(gguf)])


def test_a_hub_id_has_no_local_weights() -> None:
    assert weights_digest("org/not-a-local-path") == ""


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b"", ["short"]),
        (struct.pack("<Q", 1 << 40) + b"{}", ["bad header length", 1 << 40]),
    ],
)
def test_a_damaged_safetensors_file_is_identified_deterministically(
    tmp_path: Path, content: bytes, expected: list[object]
) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(content)
    assert file_identity(path) == ["model.safetensors", len(content), *expected]


def test_an_unreadable_file_falls_back_to_its_name_and_size(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def refuse(path: object, flags: int, *args: object) -> int:
        if str(path).endswith(".safetensors"):
            raise PermissionError(13, "Permission denied")
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", refuse)
    path = model_dir / "model-00002.safetensors"
    assert file_identity(path) == [path.name, path.stat().st_size, "unreadable"]
    assert weights_digest(model_dir) == weights_digest(model_dir)


def test_identity_fields_are_part_of_the_namespace_digest() -> None:
    base = Namespace("m@main", "layout", "float32")
    digests = {
        Namespace("m@main", "layout", "float32", config=c, weights=w).digest()
        for c, w in [("", ""), ("c1", "w1"), ("c2", "w1"), ("c1", "w2"), ("c1", ""), ("", "c1")]
    }
    assert len(digests) == 6 and base.digest() in digests
    assert base.fields() == {
        "model": "m@main",
        "config": "",
        "weights": "",
        "layout": "layout",
        "dtype": "float32",
        "parallel": "tp1",
    }
