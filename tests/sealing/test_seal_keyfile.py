"""The seal key file: its forms, its checks, rotation (decision 0024)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvoffload.core.errors import ConfigError
from kvoffload.sealing.keyfile import derive, load, parse, rotate, write_new


def private(path: Path, data: bytes) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, data)
    os.close(fd)
    return path


def test_raw_random_bytes_are_one_key(tmp_path: Path) -> None:
    material = os.urandom(32)
    keys = load(private(tmp_path / "k", material))
    assert len(keys.keys) == 1
    assert keys.sealing == derive(material)


def test_text_lines_are_keys_in_order_first_seals(tmp_path: Path) -> None:
    a, b = os.urandom(32), os.urandom(48)
    import base64

    text = f"# comment\n{a.hex()}\n\n{base64.b64encode(b).decode()}\n".encode()
    keys = load(private(tmp_path / "k", text))
    assert [k.key_id for k in keys.keys] == [derive(a).key_id, derive(b).key_id]
    assert keys.sealing.key_id == derive(a).key_id
    assert keys.by_id(derive(b).key_id) == derive(b)


@pytest.mark.parametrize(
    ("data", "said"),
    [
        (b"\x01" * 31, "at least 32 bytes"),
        (("ab" * 16 + "\n").encode(), "at least 32 bytes"),  # 16 bytes of hex
        ((("cd" * 32) + "\n" + ("cd" * 32) + "\n").encode(), "the same key twice"),
    ],
)
def test_short_or_repeated_keys_are_refused(data: bytes, said: str) -> None:
    with pytest.raises(ConfigError, match="seal_key_file") as exc:
        parse(data, "k")
    assert said in str(exc.value)


def test_a_key_file_others_may_read_is_refused(tmp_path: Path) -> None:
    path = private(tmp_path / "k", os.urandom(32))
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match="seal_key_file") as exc:
        load(path)
    assert "mode 0644" in str(exc.value)


def test_a_link_to_a_key_file_is_refused(tmp_path: Path) -> None:
    target = private(tmp_path / "k", os.urandom(32))
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(ConfigError, match="symbolic link"):
        load(link)


def test_a_missing_key_file_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="kvoffload seal-key new"):
        load(tmp_path / "absent")


def test_the_key_never_shows_in_a_repr(tmp_path: Path) -> None:
    material = os.urandom(32)
    keys = load(private(tmp_path / "k", material))
    shown = repr(keys)
    assert keys.sealing.secret.hex() not in shown and material.hex() not in shown


def test_write_new_is_exclusive_and_private(tmp_path: Path) -> None:
    path = tmp_path / "new.key"
    keys = write_new(path)
    assert len(keys.keys) == 1
    assert os.stat(path).st_mode & 0o777 == 0o600
    with pytest.raises(FileExistsError):
        write_new(path)


def test_rotate_puts_a_new_key_first_and_keeps_the_old(tmp_path: Path) -> None:
    path = tmp_path / "k"
    first = write_new(path)
    rotated = rotate(path, keep=3)
    assert len(rotated.keys) == 2
    assert rotated.keys[1] == first.sealing
    assert rotated.sealing != first.sealing
    assert os.stat(path).st_mode & 0o777 == 0o600
    again = rotate(path, keep=1)
    assert [k.key_id for k in again.keys[1:]] == [rotated.sealing.key_id]
