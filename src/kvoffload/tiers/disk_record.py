"""Where the disk tier keeps a namespace's record (:data:`DISK_RECORDS`, the disk
spec's :attr:`~kvoffload.tiers.spec.TierSpec.records`).

``<root>/kvoffload-v1/<namespace digest hex>/namespace.json``, next to the slab
files, owner-only (0600, its directory 0700), replaced atomically (written to a
temporary name in the same directory, then renamed), and only when its content
differs. Writes raise ``OSError`` (or ``ConfigError`` naming ``disk_path`` for a
directory that cannot be trusted, ``tiers/disk_files.py``); reads return None for a
missing or bad record. Pure ``os`` calls.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from kvoffload.core.identity.namespace_record import MAX_RECORD_BYTES, decode_record, encode_record
from kvoffload.core.keys import Namespace
from kvoffload.core.private_files import create_exclusive
from kvoffload.tiers.disk_files import FORMAT_DIR, disk_policy, private_namespace_dir
from kvoffload.tiers.namespace_records import NamespaceRecords

__all__ = [
    "DISK_RECORDS",
    "RECORD_FILE",
    "read_disk_record",
    "read_root_record",
    "write_disk_record",
]

RECORD_FILE = "namespace.json"

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def write_disk_record(root: Path, namespace: Namespace) -> Path:
    """Write ``namespace``'s record into its directory under the disk tier ``root``
    (created owner-only when missing); return the record's path. A record with the
    same content is left as it is; a failed write leaves no temporary file. Raises
    ``OSError``."""
    directory = private_namespace_dir(root, namespace.digest())
    path = directory / RECORD_FILE
    content = encode_record(namespace)
    with contextlib.suppress(OSError):
        if _read(path) == content:
            return path
    temporary = directory / f".{RECORD_FILE}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    fd = create_exclusive(temporary, os.O_WRONLY, disk_policy(root))
    try:
        try:
            os.write(fd, content)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    return path


def read_disk_record(directory: Path, digest_hex: str) -> dict[str, str] | None:
    """The fields recorded in namespace directory ``directory`` (whose digest is
    ``digest_hex``), or None when there is no readable, valid record. Never raises."""
    try:
        return decode_record(_read(directory / RECORD_FILE), digest_hex)
    except OSError:
        return None


def read_root_record(root: Path, digest_hex: str) -> dict[str, str] | None:
    """The fields recorded for the namespace ``digest_hex`` under the disk tier
    ``root`` (:func:`read_disk_record` of its directory). Never raises."""
    return read_disk_record(Path(root) / FORMAT_DIR / digest_hex, digest_hex)


def _read(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | _CLOEXEC | _NOFOLLOW)
    try:
        return os.read(fd, MAX_RECORD_BYTES + 1)
    finally:
        os.close(fd)


DISK_RECORDS = NamespaceRecords(label="disk", write=write_disk_record, read=read_root_record)
"""The disk tier's records; ``where`` is the tier's root (``disk_path``)."""
