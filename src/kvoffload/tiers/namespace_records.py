"""Where each tier keeps a namespace's record (:mod:`kvoffload.core.identity.namespace_record`).

- Disk: ``<root>/kvoffload-v1/<namespace digest hex>/namespace.json``, next to the
  slab files, owner-only (0600, its directory 0700), replaced atomically (written to
  a temporary name in the same directory, then renamed), and only when its content
  differs.
- Redis: the string key ``kvoffload:v1:<namespace digest hex>:namespace``, inside
  the namespace's key prefix (so ``SCAN kvoffload:v1:<digest>:*`` finds it with the
  chunks); no expiry, like the chunks, so the server may evict it.

The scheduler half writes the record once at start (:func:`write_disk_record`,
:func:`write_redis_record`): never on the hot path. Writes raise (``OSError``, the
Redis client's errors) and the caller logs them: a record is informational, the
engine never reads it. Readers (:func:`read_disk_record`, used by ``kvoffload
inspect``) return None for a missing or bad record.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvoffload.core.identity.namespace_record import MAX_RECORD_BYTES, decode_record, encode_record
from kvoffload.core.keys import Namespace
from kvoffload.core.private_files import create_exclusive
from kvoffload.tiers.disk_files import disk_policy, private_namespace_dir
from kvoffload.tiers.redis_client import PREFIX

RECORD_FILE = "namespace.json"
RECORD_SUFFIX = "namespace"
"""The last part of a namespace's record key in Redis."""

logger = logging.getLogger("kvoffload")

_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


def write_disk_record(root: Path, namespace: Namespace) -> Path:
    """Write ``namespace``'s record into its directory under the disk tier ``root``
    (created owner-only when missing); return the record's path. A record with the
    same content is left as it is. Raises ``OSError``."""
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
    ``digest_hex``), or None when there is no readable, valid record."""
    try:
        return decode_record(_read(directory / RECORD_FILE), digest_hex)
    except OSError:
        return None


def record_key(namespace_digest: bytes) -> str:
    """The Redis key of a namespace's record."""
    return f"{PREFIX}:{namespace_digest.hex()}:{RECORD_SUFFIX}"


def write_redis_record(client: Any, namespace: Namespace) -> None:
    """One ``SET`` of ``namespace``'s record. Raises the client's errors."""
    client.set(record_key(namespace.digest()), encode_record(namespace))


def _read(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | _CLOEXEC | _NOFOLLOW)
    try:
        return os.read(fd, MAX_RECORD_BYTES + 1)
    finally:
        os.close(fd)


def record_namespace(
    tier: str, write: Callable[[Any, Namespace], object], where: Any, namespace: Namespace
) -> None:
    """Write ``namespace``'s record with ``write`` into ``where`` (a disk root, a
    Redis client); a failure is logged, never raised: the record only serves
    ``kvoffload inspect``."""
    try:
        write(where, namespace)
    except Exception as exc:
        logger.warning(
            "kvoffload: could not record namespace %s in the %s tier (%s: %s); "
            "kvoffload inspect will show its fields as unknown",
            namespace.digest().hex(),
            tier,
            type(exc).__name__,
            " ".join(str(exc).split())[:200],
        )
