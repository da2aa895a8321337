"""The seal key file (``seal_key_file``, decision 0024): who may read chunks sealed
for a fleet, and forge them.

Format: either raw bytes (at least :data:`MIN_KEY_BYTES` random bytes, e.g.
``head -c 32 /dev/urandom``: one key), or text with one key per line, each line the
hex (64 digits or more) or base64 of at least :data:`MIN_KEY_BYTES` bytes, blank
lines and lines starting with ``#`` ignored (``kvoffload seal-key new`` and
``rotate`` write this form). Several keys rotate: the first seals, every key opens.

Each key's material is stretched with HKDF-SHA256 into the AES-256 key; its id (the
4 bytes a sealed chunk names) is derived from the material too, so reordering the
file never changes which key a chunk names. Two keys of one id (the same key twice,
or a 2^-32 accident) are refused.

The file is checked as every file kvoffload trusts (:mod:`kvoffload.core.private_files`):
opened without following a link, a regular file owned by this user with no permission
for group or others (0600 or 0400), at most 64 KiB. Anything else is a
:class:`~kvoffload.core.errors.ConfigError` naming ``seal_key_file``, before the engine
loads its model where vLLM allows it. The key's bytes never appear in logs, reprs or
errors.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from kvoffload.core.errors import ConfigError
from kvoffload.core.private_files import FilePolicy, create_exclusive, read_checked

OPTION = "seal_key_file"
MIN_KEY_BYTES = 32
MAX_FILE_BYTES = 1 << 16
_HEX = re.compile(r"^[0-9a-fA-F]+$")
_KEY_INFO = b"kvoffload seal v1 aes-256-gcm key"
_ID_INFO = b"kvoffload seal v1 key id"


@dataclass(frozen=True)
class SealKey:
    """One key: its id and the AES-256 key derived from its material (hidden from
    ``repr``)."""

    key_id: int
    secret: bytes = field(repr=False)


@dataclass(frozen=True)
class SealKeys:
    """The keys of a key file, in its order: :attr:`sealing` seals, every one opens."""

    keys: tuple[SealKey, ...]
    path: str = ""

    @property
    def sealing(self) -> SealKey:
        return self.keys[0]

    def by_id(self, key_id: int) -> SealKey | None:
        for key in self.keys:
            if key.key_id == key_id:
                return key
        return None

    def ids(self) -> list[str]:
        """Each key's id as 8 hex digits, in order (for start-up lines and the CLI)."""
        return [f"{k.key_id:08x}" for k in self.keys]


def _hkdf(material: bytes, info: bytes, length: int) -> bytes:
    """HKDF-SHA256 (RFC 5869) with an empty salt: extract, then expand (``length`` at
    most 32: one block)."""
    prk = hmac.new(b"\x00" * 32, material, hashlib.sha256).digest()
    return hmac.new(prk, info + b"\x01", hashlib.sha256).digest()[:length]


def derive(material: bytes) -> SealKey:
    """The key of ``material`` (at least :data:`MIN_KEY_BYTES`, else ``ValueError``)."""
    if len(material) < MIN_KEY_BYTES:
        raise ValueError(f"a key is at least {MIN_KEY_BYTES} bytes, this one {len(material)}")
    return SealKey(
        key_id=int.from_bytes(_hkdf(material, _ID_INFO, 4), "little"),
        secret=_hkdf(material, _KEY_INFO, 32),
    )


def _text_keys(data: bytes) -> list[bytes] | None:
    """The keys of a text key file, or None when ``data`` is not one."""
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        return None
    lines = [line.strip() for line in text.splitlines()]
    lines = [line for line in lines if line and not line.startswith("#")]
    if not lines:
        return None
    keys: list[bytes] = []
    for line in lines:
        try:
            if _HEX.match(line) and len(line) % 2 == 0:
                keys.append(bytes.fromhex(line))
            else:
                keys.append(
                    base64.b64decode(line.replace("-", "+").replace("_", "/"), validate=True)
                )
        except (ValueError, binascii.Error):
            return None
    return keys


def parse(data: bytes, path: str = "") -> SealKeys:
    """The keys in a key file's bytes (see the module docstring); ``ConfigError``
    naming :data:`OPTION` when there is none, one is short, or two share an id."""
    materials = _text_keys(data)
    if materials is None:
        materials = [data]  # raw random bytes: one key
    keys: list[SealKey] = []
    for number, material in enumerate(materials, 1):
        try:
            key = derive(material)
        except ValueError as exc:
            raise ConfigError(OPTION, f"{path}: key {number}: {exc}") from None
        if any(k.key_id == key.key_id for k in keys):
            raise ConfigError(
                OPTION, f"{path}: key {number} has the id {key.key_id:08x} of an earlier key "
                "(the same key twice?): remove one",
            )  # fmt: skip
        keys.append(key)
    return SealKeys(tuple(keys), path)


def policy(path: str | Path) -> FilePolicy:
    return FilePolicy(share=f"seal key file {path}", key=OPTION)


def load(path: str | Path) -> SealKeys:
    """The keys of the key file at ``path``, checked (module docstring)."""
    rule = policy(path)
    try:
        data = read_checked(path, rule, MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(
            OPTION, f"{path} does not exist (make one: kvoffload seal-key new {path})"
        ) from None
    except OSError as exc:
        raise ConfigError(OPTION, f"{path} cannot be read: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(OPTION, f"{path} is larger than {MAX_FILE_BYTES} bytes: not a key file")
    return parse(data, str(path))


def new_key_line() -> str:
    """A fresh random key as a key file's line (hex of 32 bytes from ``os.urandom``)."""
    return os.urandom(MIN_KEY_BYTES).hex()


def write_new(path: str | Path) -> SealKeys:
    """Create the key file ``path`` (it must not exist) with one fresh key, mode 0600,
    created exclusively without following a link; its keys."""
    text = f"# kvoffload seal keys: the first seals, every key opens\n{new_key_line()}\n"
    fd = create_exclusive(path, os.O_WRONLY, policy(path))
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    return load(path)


def rotate(path: str | Path, keep: int) -> SealKeys:
    """Put a fresh key first in the key file ``path`` (checked), keeping the ``keep``
    newest old keys after it, so engines restarted with the file seal with the new key
    and still open what the old ones sealed. Written atomically (a reader sees the old
    file or the new one)."""
    from kvoffload.core.private_files import replace_atomically

    data = read_checked(path, policy(path), MAX_FILE_BYTES + 1)
    parse(data, str(path))  # the file as it is must be a valid key file
    lines = _text_keys(data) or [data]
    kept = [m.hex() for m in lines[: max(0, keep)]]
    text = (
        "\n".join(
            ["# kvoffload seal keys: the first seals, every key opens", new_key_line(), *kept]
        )
        + "\n"
    )

    def write(fd: int) -> None:
        os.write(fd, text.encode())

    replace_atomically(Path(path), policy(path), write)
    return load(path)
