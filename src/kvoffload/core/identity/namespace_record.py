"""A namespace's record: its fields as a small JSON document, for inspection.

Tiers name a namespace by its digest only (slab directories, Redis key prefixes), so
the digest alone says nothing of the model behind it. The scheduler half writes one
record per namespace next to its chunks at start (``tiers/namespace_records.py``:
``namespace.json`` in the disk tier's namespace directory, ``tiers/disk_record.py``;
one Redis key, ``tiers/redis_record.py``) and
``kvoffload inspect`` reads it back. The record is informational: the engine never
reads it, and a missing or bad record only makes inspect show "fields unknown".

Document: ``{"format": FORMAT, "digest": <namespace digest hex>, "model": ...,
"config": ..., "weights": ..., "layout": ..., "dtype": ..., "parallel": ...}`` with
sorted keys.
"""

from __future__ import annotations

import json

from kvoffload.core.errors import ConfigError
from kvoffload.core.keys import Namespace

FORMAT = "kvoffload/namespace-record/v1"
FIELDS = ("model", "config", "weights", "layout", "dtype", "parallel")
"""The fields a record holds, in the order inspect shows them."""

MAX_RECORD_BYTES = 64 * 1024
"""A record longer than this is not read (a record is a few hundred bytes)."""


def encode_record(namespace: Namespace) -> bytes:
    """``namespace``'s record as UTF-8 JSON."""
    document = {"format": FORMAT, "digest": namespace.digest().hex(), **namespace.fields()}
    return json.dumps(document, sort_keys=True).encode()


def decode_record(raw: bytes | str, digest_hex: str) -> dict[str, str] | None:
    """The fields of a record of the namespace ``digest_hex``, or None when ``raw``
    is not such a record (not JSON, another format, another digest, a field missing
    or not a string, fields whose namespace digest is not ``digest_hex``). Never
    raises."""
    if len(raw) > MAX_RECORD_BYTES:
        return None
    try:
        document = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(document, dict):
        return None
    if document.get("format") != FORMAT or document.get("digest") != digest_hex:
        return None
    fields = {name: document.get(name) for name in FIELDS}
    if not all(isinstance(value, str) for value in fields.values()):
        return None
    strings = {name: str(value) for name, value in fields.items()}
    try:
        if Namespace(**strings).digest().hex() != digest_hex:
            return None  # fields that do not make this namespace
    except ConfigError:
        return None
    return strings
