"""``kvoffload seal-key``: new, rotate, show; refusals as one line and status 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload.cli import main
from kvoffload.sealing.keyfile import load


def test_new_rotate_show(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "seal.key"
    assert main(["seal-key", "new", str(path)]) == 0
    first = load(path).ids()[0]
    assert main(["seal-key", "rotate", str(path)]) == 0
    assert main(["seal-key", "show", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{path}: seals with key {first}"
    second = load(path).ids()[0]
    assert out[-1] == f"{path}: seals with key {second}; also opens {first}"
    assert first not in path.read_text().split("\n")[0]  # ids, never key material


def test_refusals_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "seal.key"
    assert main(["seal-key", "new", str(path)]) == 0
    assert main(["seal-key", "new", str(path)]) == 2  # never overwritten
    path.chmod(0o644)
    assert main(["seal-key", "show", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "mode 0644" in err[1] and "seal_key_file" in err[1]
