"""A ``disk_path`` in (or being) a sticky directory that another user owns is refused
at start (``core/private_files.py`` ``check_root``, the check share roots pass too):
the owner of a sticky directory may rename anything in it, so that user could take
``kvoffload-v1`` away and have the next start refused. Root's sticky directories
(``/tmp``) and this user's are accepted. The tests run as root; the other user is uid
65534 (``tests/share/other_user.py``)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.share.other_user import NOBODY, as_other_user

from kvoffload.core.errors import ConfigError
from kvoffload.core.private_files import check_root, untrusted_sticky_dir
from kvoffload.share.paths import SharePaths
from kvoffload.tiers.disk import DiskStore
from kvoffload.tiers.disk_files import FORMAT_DIR, disk_policy, private_namespace_dir

NS = bytes(range(16))


@pytest.fixture
def others_sticky() -> Iterator[Path]:
    """A sticky directory every user may write (mode 1777) that uid 65534 owns."""
    root = Path(tempfile.mkdtemp(prefix="kvo-", dir="/tmp"))
    os.chown(root, NOBODY, NOBODY)
    os.chmod(root, 0o1777)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_the_owner_of_a_sticky_directory_can_rename_what_this_user_made_there(
    others_sticky: Path,
) -> None:
    """Why the refusal: the rename the other user needs works (as their own user)."""
    victim = others_sticky / FORMAT_DIR
    victim.mkdir(mode=0o700)

    def rename() -> bool:
        os.rename(victim, others_sticky / "gone")
        return True

    assert as_other_user(rename)
    assert not victim.exists()


def test_a_disk_path_that_is_another_users_sticky_directory_is_refused(
    others_sticky: Path,
) -> None:
    with pytest.raises(ConfigError) as refused:
        DiskStore(others_sticky, NS, 0, 4096, 4)
    message = str(refused.value)
    assert refused.value.field == "disk_path"
    assert f"{others_sticky} is a sticky directory owned by uid {NOBODY}" in message
    assert "choose another disk_path" in message
    assert os.listdir(others_sticky) == []  # nothing made there


def test_a_disk_path_inside_another_users_sticky_directory_is_refused(
    others_sticky: Path,
) -> None:
    mine = others_sticky / "kv"
    mine.mkdir(mode=0o700)  # this user's own directory: its parent's owner may rename it
    with pytest.raises(ConfigError, match=f"in sticky directory {others_sticky}, which is owned"):
        private_namespace_dir(mine, NS)
    assert os.listdir(mine) == []
    missing = others_sticky / "not-yet"
    with pytest.raises(ConfigError, match="'disk_path'"):
        private_namespace_dir(missing, NS)
    assert not missing.exists()  # refused before it was made


def test_roots_sticky_directories_and_this_users_are_accepted(open_root: Path) -> None:
    assert untrusted_sticky_dir(Path("/tmp")) is None
    check_root(Path("/tmp"), disk_policy(Path("/tmp")))  # root's /tmp: no error
    assert os.stat(open_root).st_uid == os.geteuid()
    store = DiskStore(open_root, NS, 0, 4096, 4)  # a sticky directory of this user's
    store.close()
    assert (open_root / FORMAT_DIR / NS.hex()).is_dir()


def test_a_share_root_of_another_users_is_refused_the_same_way(others_sticky: Path) -> None:
    with pytest.raises(ConfigError, match=f"'host_share_root'.*owned by uid {NOBODY}"):
        SharePaths("x", others_sticky).ensure_dir()
    assert os.listdir(others_sticky) == []
