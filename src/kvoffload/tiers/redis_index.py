"""The scheduler half's view of the Redis/Valkey tier: a
:class:`~kvoffload.tiers.remote_index.RemoteIndex` (cached probes, back-off, None
while asking; see there) over :class:`RedisExistence`, which asks the server.

A probe is one pipelined round trip: per chunk one ``EXISTS`` of every rank's share
(it counts those that exist; the chunk is present when every share exists), or, on a
cluster with several ranks, one ``EXISTS`` per share (a chunk's shares live in
different slots). Key names are :func:`~kvoffload.tiers.redis_client.key_name`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvoffload.core.keys import ChunkKey
from kvoffload.tiers.redis_client import LazyCluster, key_name
from kvoffload.tiers.remote_index import RemoteIndex, RemoteIndexOptions

__all__ = ["NAME", "RedisExistence", "RedisIndex"]

NAME = "redis"
"""The Redis tier's name, as its spec (:data:`~kvoffload.tiers.redis_tier.REDIS`)
names it: the index's ``name`` and its counters' ``tier`` label."""


class RedisExistence:
    """Whether chunks of the namespace ``namespace_digest`` exist in the server that
    ``client`` (the caller's; thread-safe, as redis-py's clients are) talks to, each
    split in ``world_size`` shares (an
    :class:`~kvoffload.tiers.remote_index.ExistenceQuery`). Keeps no state; raises the
    client's errors."""

    def __init__(self, client: Any, namespace_digest: bytes, world_size: int) -> None:
        self.client = client
        self.digest = namespace_digest
        self.world_size = world_size
        self._per_share = isinstance(client, LazyCluster) and world_size > 1

    def exists(self, keys: Sequence[ChunkKey]) -> list[bool]:
        """Whether every rank's share of each key exists (module docstring)."""
        pipe = self.client.pipeline(transaction=False)
        ranks = range(self.world_size)
        for key in keys:
            names = [key_name(self.digest, key, rank) for rank in ranks]
            if self._per_share:
                for name in names:
                    pipe.exists(name)
            else:
                pipe.exists(*names)
        answers = pipe.execute()
        if not self._per_share:
            return [n == self.world_size for n in answers]
        n = self.world_size
        return [all(answers[i * n : (i + 1) * n]) for i in range(len(keys))]


class RedisIndex(RemoteIndex):
    """The Redis tier's index (named :data:`NAME`) of the namespace
    ``namespace_digest`` with ``world_size`` shares per chunk, asking through
    ``client`` (the caller's; not closed by :meth:`close`)."""

    def __init__(
        self,
        client: Any,
        namespace_digest: bytes,
        world_size: int,
        options: RemoteIndexOptions | None = None,
    ) -> None:
        self.client = client
        self.digest = namespace_digest
        self.world_size = world_size
        super().__init__(NAME, RedisExistence(client, namespace_digest, world_size), options)
