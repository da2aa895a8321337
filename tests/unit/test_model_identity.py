"""The model identity's digests: canonical configuration data and weight files by
content (read once, remembered until a file changes); deterministic, and never
raising."""

from __future__ import annotations

import enum
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffload.core.identity import content_digest
from kvoffload.core.identity.content_digest import DigestCache
from kvoffload.core.identity.model import (
    canonical,
    digest_of,
    file_identity,
    weights_digest,
)
from kvoffload.core.keys import Namespace


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
    code = "from kvoffload.core.identity.model import digest_of\nprint(digest_of({'a': 1}))\n"
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


def test_a_change_of_any_byte_changes_the_digest_even_with_size_and_mtime_kept(
    model_dir: Path,
) -> None:
    """An in-place rewrite of one tensor of a large file (a partial fine-tune copied
    over), its size and modification time kept: the whole content is digested."""
    path = model_dir / "model-00001.safetensors"
    write_safetensors(path, [300_000])  # 1.2 MB of data
    stamp = path.stat()
    before = weights_digest(model_dir)
    with open(path, "r+b") as f:
        f.seek(stamp.st_size // 3)  # between any start, middle and end samples
        f.write(b"\x01\x02\x03\x04")
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert path.stat().st_size == stamp.st_size
    assert path.stat().st_mtime_ns == stamp.st_mtime_ns
    assert weights_digest(model_dir) != before


def test_copies_of_the_same_files_elsewhere_have_the_same_digest(
    model_dir: Path, tmp_path: Path
) -> None:
    """Engines on two machines (other inodes, other times) share a Redis tier."""
    other = tmp_path / "copy" / "model"
    other.mkdir(parents=True)
    for f in model_dir.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    assert weights_digest(other) == weights_digest(model_dir)


def test_a_digest_is_remembered_until_the_file_changes(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = DigestCache(tmp_path / "cache")
    first = weights_digest(model_dir, cache)
    reads: list[Path] = []
    real = content_digest.hash_file

    def counted(path: Path) -> str:
        reads.append(path)
        return real(path)

    monkeypatch.setattr(content_digest, "hash_file", counted)
    assert weights_digest(model_dir, DigestCache(tmp_path / "cache")) == first  # another process
    assert reads == []
    target = model_dir / "model-00002.safetensors"
    write_safetensors(target, [32], fill=3)  # same size, new bytes: a new change time
    assert weights_digest(model_dir, cache) != first
    assert reads == [target]


def test_a_cache_directory_of_another_user_or_writable_by_others_is_not_used(
    model_dir: Path, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    cache = DigestCache(shared)
    assert cache.root is None  # computed each time, never read from a file others write
    assert weights_digest(model_dir, cache) == weights_digest(model_dir)
    assert list(shared.iterdir()) == []


def test_a_remembered_entry_that_is_a_symlink_is_not_read(model_dir: Path, tmp_path: Path) -> None:
    cache = DigestCache(tmp_path / "cache")
    truth = weights_digest(model_dir, cache)
    assert cache.root is not None
    for entry in cache.root.glob("*.json"):
        decoy = tmp_path / f"decoy-{entry.name}"
        document = json.loads(entry.read_text())
        document["digest"] = "0" * 32
        decoy.write_text(json.dumps(document))
        entry.unlink()
        entry.symlink_to(decoy)
    assert weights_digest(model_dir, cache) == truth


def test_other_weight_files_are_digested_by_content(tmp_path: Path) -> None:
    """A checkpoint of ``*.bin`` files only (vLLM loads them when there is no
    safetensors file)."""
    pt = tmp_path / "pytorch_model.bin"
    pt.write_bytes(b"x" * 100)
    before = weights_digest(tmp_path)
    pt.write_bytes(b"y" * 100)  # replaced by a file of the same size
    assert weights_digest(tmp_path) != before


def test_a_single_weight_file_is_its_own_identity(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    digest = content_digest.hash_file(gguf)
    assert weights_digest(gguf) == digest_of([file_identity(gguf, digest)])


def test_a_hub_id_has_no_local_weights() -> None:
    assert weights_digest("org/not-a-local-path") == ""


def test_an_unreadable_file_is_identified_by_its_name_and_the_error(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_open = os.open

    def refuse(path: object, flags: int, *args: object) -> int:
        if str(path).endswith(".safetensors"):
            raise PermissionError(13, "Permission denied")
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", refuse)
    path = model_dir / "model-00002.safetensors"
    digest = content_digest.DigestCache(None).digest(path)
    assert digest == "unreadable:PermissionError"
    assert file_identity(path, digest) == [path.name, path.stat().st_size, digest]
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
