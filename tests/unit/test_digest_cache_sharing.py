"""The weights digest costs one read of each file per engine
(``core/identity/content_digest.py``): the processes of an engine share the digests
through the cache folder, or, when that folder cannot be used, through a private
folder in the temporary directory, named once by a warning; within one process a
second call reads nothing, even with no folder at all."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvoffload.core.identity import content_digest
from kvoffload.core.identity.content_digest import DigestCache, fallback_dir
from kvoffload.core.identity.model import weights_digest


@pytest.fixture
def model(tmp_path: Path) -> Path:
    root = tmp_path / "model"
    root.mkdir()
    for i in range(3):
        (root / f"model-{i:05d}.safetensors").write_bytes(bytes([i]) * 4096)
    return root


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    seen: list[Path] = []
    real = content_digest.hash_file

    def counted(path: Path) -> str:
        seen.append(Path(path))
        return real(path)

    monkeypatch.setattr(content_digest, "hash_file", counted)
    return seen


@pytest.fixture(params=["not-a-folder", "others-may-write"])
def unusable(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """``KVOFFLOAD_CACHE_DIR`` names a folder whose ``digests`` cannot be used (a
    plain file, as a read-only home fails the same way: a folder that cannot be made;
    or a folder every user may write: refused), the temporary directory is the test's
    own, and this process has no cache opened yet."""
    configured = tmp_path / "configured"
    if request.param == "not-a-folder":
        configured.write_text("a file, not a folder")
    else:
        (configured / "digests").mkdir(parents=True)
        (configured / "digests").chmod(0o777)
    temporary = tmp_path / "tmp"
    temporary.mkdir(mode=0o700)
    monkeypatch.setenv("KVOFFLOAD_CACHE_DIR", str(configured))
    monkeypatch.setenv("TMPDIR", str(temporary))
    monkeypatch.setattr(tempfile, "tempdir", str(temporary))
    monkeypatch.setattr(content_digest, "_shared", {})
    # kvoffload's logger as a library's, whatever an earlier test in this process did:
    # routed through vLLM's logging (no propagation, a forwarding handler) while vLLM's
    # own logger has no handler, each record would reach the capture twice.
    ours = logging.getLogger("kvoffload")
    monkeypatch.setattr(ours, "handlers", [])
    monkeypatch.setattr(ours, "propagate", True)
    return configured / "digests"


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_an_unusable_cache_folder_is_named_once_with_the_reason_and_the_fix(
    model: Path, unusable: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        first = weights_digest(model)
        assert DigestCache.default() is DigestCache.default()  # one object per process
        assert weights_digest(model) == first
    (warning,) = warnings_of(caplog)
    reason = "File exists" if unusable.parent.is_file() else "others than its owner may write"
    assert f"cannot use the weights digest cache folder {unusable} (" in warning
    assert reason in warning
    assert "Fix: set KVOFFLOAD_CACHE_DIR" in warning
    assert f"remembered in {fallback_dir()} instead" in warning
    assert not unusable.is_dir() or not any(unusable.iterdir())  # nothing written there
    mode = os.stat(fallback_dir()).st_mode & 0o777
    assert mode == 0o700  # the fallback is private


def test_two_calls_in_one_process_read_each_file_once(
    model: Path, unusable: Path, reads: list[Path]
) -> None:
    first = weights_digest(model)  # the scheduler half
    second = weights_digest(model)  # a worker in the same process
    assert first == second
    assert sorted(reads) == sorted(model.iterdir())


def test_with_no_folder_at_all_one_process_still_reads_each_file_once(
    model: Path,
    unusable: Path,
    reads: list[Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    (tmp_path / "tmp").chmod(0o777)  # not sticky: the fallback is refused too
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        assert weights_digest(model) == weights_digest(model)
    assert DigestCache.default().root is None
    assert sorted(reads) == sorted(model.iterdir())
    (warning,) = warnings_of(caplog)
    assert "not sticky" in warning
    assert "every process of the engine reads every weight file in full at every start" in (warning)


def test_another_process_of_the_engine_takes_the_digests_from_the_fallback(
    model: Path, unusable: Path
) -> None:
    """A worker process after its scheduler half (or the reverse): no file read again."""
    first = weights_digest(model)
    code = (
        "import sys\n"
        "from kvoffload.core.identity import content_digest\n"
        "from kvoffload.core.identity.model import weights_digest\n"
        "reads = []\n"
        "real = content_digest.hash_file\n"
        "content_digest.hash_file = lambda p: reads.append(p) or real(p)\n"
        "print(weights_digest(sys.argv[1]), len(reads))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(model)],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ),
    )
    assert out.stdout.split() == [first, "0"]


def test_a_rewritten_file_is_read_again_by_the_process_that_remembered_it(
    model: Path, unusable: Path, reads: list[Path]
) -> None:
    first = weights_digest(model)
    target = model / "model-00001.safetensors"
    target.write_bytes(b"\x07" * 4096)  # same size, new bytes: a new change time
    reads.clear()
    assert weights_digest(model) != first
    assert reads == [target]
