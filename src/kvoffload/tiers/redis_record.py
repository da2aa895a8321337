"""Where the Redis/Valkey tier keeps a namespace's record (:data:`REDIS_RECORDS`, the
Redis spec's :attr:`~kvoffload.tiers.spec.TierSpec.records`).

The string key ``kvoffload:v1:<namespace digest hex>:namespace``, inside the
namespace's key prefix (so ``SCAN kvoffload:v1:<digest>:*`` finds it with the
chunks); no expiry, like the chunks, so the server may evict it. A write is one
``SET``, a read one ``GET``; both raise the client's errors. Importing this module
imports no client library: callers pass the client.
"""

from __future__ import annotations

from typing import Any

from kvoffload.core.identity.namespace_record import decode_record, encode_record
from kvoffload.core.keys import Namespace
from kvoffload.tiers.namespace_records import NamespaceRecords
from kvoffload.tiers.redis_client import PREFIX

__all__ = [
    "RECORD_SUFFIX",
    "REDIS_RECORDS",
    "read_redis_record",
    "record_key",
    "write_redis_record",
]

RECORD_SUFFIX = "namespace"
"""The last part of a namespace's record key in Redis."""


def record_key(namespace_digest: bytes) -> str:
    """The Redis key of a namespace's record."""
    return f"{PREFIX}:{namespace_digest.hex()}:{RECORD_SUFFIX}"


def write_redis_record(client: Any, namespace: Namespace) -> None:
    """One ``SET`` of ``namespace``'s record. Raises the client's errors."""
    client.set(record_key(namespace.digest()), encode_record(namespace))


def read_redis_record(client: Any, digest_hex: str) -> dict[str, str] | None:
    """The fields recorded for the namespace ``digest_hex`` (one ``GET``); None when
    the key is missing or not a valid record. Raises the client's errors."""
    value = client.get(record_key(bytes.fromhex(digest_hex)))
    return decode_record(value, digest_hex) if isinstance(value, (bytes, str)) else None


REDIS_RECORDS = NamespaceRecords(label="Redis", write=write_redis_record, read=read_redis_record)
"""The Redis tier's records; ``where`` is a client of the server."""
