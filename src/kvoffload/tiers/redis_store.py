"""The worker's side of the Redis/Valkey tier: one rank's chunk shares, pipelined.

``write_many`` stores chunks (one ``SET`` per chunk, one round trip per call);
``read_many`` fetches and verifies them into caller buffers, deleting any value
that fails verification; ``delete_many`` drops chunks. Values are a
:mod:`kvoffload.core.chunk_format` header and the payload. Connection errors and
timeouts raise (the tier worker fails the whole job); a missing or bad value fails
only its chunk (a reason string per chunk). Used from the worker's tier threads;
redis-py clients are thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvoffload.core.chunk_format import HEADER_BYTES, IntegrityError, encode_header, verify
from kvoffload.core.keys import ChunkKey, shard_key
from kvoffload.tiers.redis_client import key_name


class RedisStore:
    def __init__(self, client: Any, namespace_digest: bytes, rank: int, payload_bytes: int):
        self.client = client
        self.digest = namespace_digest
        self.rank = rank
        self.payload_bytes = payload_bytes

    def name(self, key: ChunkKey) -> str:
        return key_name(self.digest, key, self.rank)

    def write_many(
        self, items: Sequence[tuple[ChunkKey, memoryview]], slots: Sequence[int] = ()
    ) -> list[str | None]:
        """Store every chunk (``slots`` is for slotted tiers; Redis keys by chunk)."""
        pipe = self.client.pipeline(transaction=False)
        for key, payload in items:
            value = bytearray(HEADER_BYTES + len(payload))  # the one copy of the payload
            value[:HEADER_BYTES] = encode_header(self.digest, shard_key(key, self.rank), payload)
            value[HEADER_BYTES:] = payload
            pipe.set(self.name(key), memoryview(value))  # sent as is (see redis_client)
        pipe.execute()
        return [None] * len(items)

    def read_many(
        self, keys: Sequence[ChunkKey], slots: Sequence[int], outs: Sequence[memoryview]
    ) -> list[str | None]:
        """Per chunk: None (read and verified into its buffer), ``"missing"``, or
        ``"integrity:<reason>"`` (the bad value is deleted)."""
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.get(self.name(key))
        values = pipe.execute()
        failures: list[str | None] = []
        bad: list[str] = []
        for key, value, out in zip(keys, values, outs, strict=True):
            if value is None:
                failures.append("missing")
                continue
            try:
                out[:] = verify(value, self.digest, shard_key(key, self.rank), self.payload_bytes)
            except IntegrityError as exc:
                failures.append(f"integrity:{exc.reason.value}")
                bad.append(self.name(key))
                continue
            failures.append(None)
        if bad:
            self.client.delete(*bad)
        return failures

    def delete_many(self, keys: Sequence[ChunkKey]) -> None:
        if keys:
            self.client.delete(*(self.name(k) for k in keys))
