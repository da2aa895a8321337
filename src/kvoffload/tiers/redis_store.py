"""The worker's side of the Redis/Valkey tier: one rank's chunk shares, pipelined.

``write_many`` stores chunks (one ``SET`` per chunk, one round trip per call);
``read_many`` fetches and verifies them into caller buffers, deleting any value
that fails verification; ``delete_many`` drops chunks. Values are a
:mod:`kvoffload.core.chunk_format` header and the payload. Connection errors and
timeouts raise (the tier worker fails the whole job); a missing or bad value fails
only its chunk (a :class:`~kvoffload.core.failures.ChunkFailure`). ``groups`` (one
per chunk, or empty: every chunk is group 0) are the chunks' KV cache groups, written
into each header and expected back when read: a value of another group is an
integrity failure (``group``) and deleted like any bad value. Used from the worker's
tier threads; redis-py clients are thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from typing import Any

from kvoffload.core.chunk_format import (
    HEADER_BYTES,
    IntegrityError,
    IntegrityReason,
    check_header,
    check_payload,
    encode_header,
    verify,
)
from kvoffload.core.failures import MISSING, ChunkFailure, integrity_failure
from kvoffload.core.keys import ChunkKey, shard_key
from kvoffload.tiers.redis_client import key_name, zero_copy
from kvoffload.tiers.redis_reader import get_into, set_from


class RedisStore:
    """``payload_bytes``: each chunk's payload; with ``variable``, the most a payload
    holds (a variable-size codec's chunks, decision 0023: a value's header names its
    own length, at most that, and a read fills the front of its buffer)."""

    def __init__(
        self,
        client: Any,
        namespace_digest: bytes,
        rank: int,
        payload_bytes: int,
        groups: int = 1,
        *,
        variable: bool = False,
    ):
        self.client = client
        self.digest = namespace_digest
        self.rank = rank
        self.payload_bytes = payload_bytes
        self.variable = variable
        self.groups = groups  # the layout's KV cache groups, recorded in every header
        # Straight from and into host slots where the client allows it (not the
        # cluster client); else redis-py's path with one copy each way.
        self.zero_copy = zero_copy(client)

    def name(self, key: ChunkKey) -> str:
        return key_name(self.digest, key, self.rank)

    def write_many(
        self,
        items: Sequence[tuple[ChunkKey, memoryview]],
        slots: Sequence[int] = (),
        groups: Sequence[int] = (),
    ) -> list[ChunkFailure | None]:
        """Store every chunk (``slots`` is for slotted tiers; Redis keys by chunk)."""
        values = [
            (self.name(key), (self._header(key, payload, group), payload))
            for (key, payload), group in zip(items, groups or repeat(0, len(items)), strict=True)
        ]
        if self.zero_copy:  # straight from the host slot; the caller keeps it pinned
            set_from(self.client, values)
        else:
            pipe = self.client.pipeline(transaction=False)
            for name, (header, payload) in values:
                pipe.set(name, b"".join((header, payload)))
            pipe.execute()
        return [None] * len(items)

    def _header(self, key: ChunkKey, payload: memoryview, group: int) -> bytes:
        storage_key = shard_key(key, self.rank)
        return encode_header(self.digest, storage_key, payload, group=group, groups=self.groups)

    def read_many(
        self,
        keys: Sequence[ChunkKey],
        slots: Sequence[int],
        outs: Sequence[memoryview],
        groups: Sequence[int] = (),
    ) -> list[ChunkFailure | None]:
        """Per chunk: None (read and verified into its buffer), :data:`MISSING`, or an
        ``INTEGRITY`` failure with the reason (the bad value is deleted). A failed
        chunk's buffer may hold unverified bytes."""
        failures: list[ChunkFailure | None] = []
        bad: list[str] = []
        verdicts = self._fetch(keys, outs, groups or [0] * len(keys))
        for key, verdict in zip(keys, verdicts, strict=True):
            if isinstance(verdict, IntegrityError):
                failures.append(integrity_failure(verdict.reason.value))
                bad.append(self.name(key))
            else:
                failures.append(verdict)
        if bad:
            self.client.delete(*bad)
        return failures

    def _fetch(
        self, keys: Sequence[ChunkKey], outs: Sequence[memoryview], groups: Sequence[int]
    ) -> list[ChunkFailure | IntegrityError | None]:
        """Each chunk, expected of its group in ``groups``, into its buffer: None
        (verified), :data:`MISSING`, or the error."""
        verdicts: list[ChunkFailure | IntegrityError | None] = []
        if self.zero_copy:
            names = [self.name(k) for k in keys]
            headers = [memoryview(bytearray(HEADER_BYTES)) for _ in keys]
            answers = get_into(self.client, names, headers, outs)
            each = zip(keys, answers, headers, outs, groups, strict=True)
            for key, answer, header, out, group in each:
                try:
                    if answer == "size":
                        raise IntegrityError(IntegrityReason.SIZE)
                    if answer == "type":
                        raise IntegrityError(IntegrityReason.MAGIC, "not a string value")
                    if answer == "missing":
                        verdicts.append(MISSING)
                        continue
                    size = int(answer[len("short:") :]) if answer.startswith("short:") else len(out)
                    if size != len(out) and not self.variable:
                        raise IntegrityError(IntegrityReason.SIZE)
                    expected = check_header(
                        header,
                        self.digest,
                        shard_key(key, self.rank),
                        size if self.variable else self.payload_bytes,
                        group=group,
                    )
                    check_payload(out[:size], self.payload_bytes, expected, at_most=self.variable)
                    verdicts.append(None)
                except IntegrityError as exc:
                    verdicts.append(exc)
            return verdicts
        pipe = self.client.pipeline(transaction=False)
        for key in keys:
            pipe.get(self.name(key))
        values = pipe.execute(raise_on_error=False)
        for key, value, out, group in zip(keys, values, outs, groups, strict=True):
            if value is None:
                verdicts.append(MISSING)
                continue
            try:
                if isinstance(value, Exception):
                    if not str(value).startswith("WRONGTYPE"):
                        raise value
                    raise IntegrityError(IntegrityReason.MAGIC, "not a string value")
                storage_key = shard_key(key, self.rank)
                payload = verify(
                    value, self.digest, storage_key, self.payload_bytes, group=group,
                    at_most=self.variable,
                )  # fmt: skip
                out[: len(payload)] = payload
                verdicts.append(None)
            except IntegrityError as exc:
                verdicts.append(exc)
        return verdicts

    def delete_many(self, keys: Sequence[ChunkKey]) -> None:
        if keys:
            self.client.delete(*(self.name(k) for k in keys))
