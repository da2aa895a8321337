"""The disk tier's directories and files are the user's own (decision 0018's checks,
naming ``disk_path``): in a ``disk_path`` every user can write, another user who made
``kvoffload-v1`` or a namespace directory first, or planted a link, gets the engine
refused with a clear error; files are owner-only whatever the umask; a ``disk_path``
others may replace entries of is refused. The other user is a forked child that drops
to uid 65534 (``tests/share/other_user.py``)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from tests.share.other_user import as_other_user

from kvoffload.core.errors import ConfigError
from kvoffload.tiers.disk import DiskStore, slab_path
from kvoffload.tiers.disk_files import FORMAT_DIR, private_namespace_dir
from kvoffload.tiers.disk_lock import DiskLock

NS = bytes(range(16))


def store(root: Path) -> DiskStore:
    return DiskStore(root, NS, 0, 4096, 4)


def test_a_format_directory_another_user_made_is_refused(open_root: Path) -> None:
    def squat() -> None:
        (open_root / FORMAT_DIR).mkdir(mode=0o777)
        os.chmod(open_root / FORMAT_DIR, 0o777)

    as_other_user(squat)
    with pytest.raises(ConfigError) as refused:
        store(open_root)
    assert refused.value.field == "disk_path"
    assert "owned by uid 65534" in str(refused.value)
    with pytest.raises(ConfigError):
        DiskLock.acquire(open_root, NS)


def test_a_namespace_directory_that_is_a_link_is_refused(open_root: Path) -> None:
    elsewhere = open_root / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (open_root / FORMAT_DIR).mkdir(mode=0o700)
    (open_root / FORMAT_DIR / NS.hex()).symlink_to(elsewhere)
    with pytest.raises(ConfigError, match="symbolic link"):
        store(open_root)
    assert list(elsewhere.iterdir()) == []


def test_a_planted_slab_link_is_never_written_through(tmp_path: Path) -> None:
    private_namespace_dir(tmp_path, NS)
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    slab_path(tmp_path, NS, 0).symlink_to(target)
    with pytest.raises(ConfigError, match="symbolic link"):
        store(tmp_path)
    assert target.read_bytes() == b"keep"


def test_a_disk_path_others_may_replace_entries_of_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    os.chmod(root, 0o777)  # writable by all, not sticky
    with pytest.raises(ConfigError, match="not sticky"):
        store(root)


def test_files_are_owner_only_whatever_the_umask(open_root: Path) -> None:
    previous = os.umask(0)
    try:
        slab = store(open_root)
        slab.close()
        lock = DiskLock.acquire(open_root, NS)
        lock.release()
    finally:
        os.umask(previous)
    for path in (
        open_root / FORMAT_DIR,
        open_root / FORMAT_DIR / NS.hex(),
        slab_path(open_root, NS, 0),
        open_root / FORMAT_DIR / NS.hex() / "lock",
    ):
        mode = stat.S_IMODE(os.lstat(path).st_mode)
        assert mode & 0o077 == 0, f"{path} has mode {mode:04o}"

    def read_slab() -> str:
        try:
            slab_path(open_root, NS, 0).read_bytes()
        except OSError as exc:
            return type(exc).__name__
        return "read"

    assert as_other_user(read_slab) == "PermissionError"
