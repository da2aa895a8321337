"""How the Redis index asks a server whether chunks exist, against a fake client on a
fake clock: one pipelined ``EXISTS`` of every rank's share per chunk. What the index
does with the answers (caching, back-off, deferrals) is the remote index's, in
test_remote_index.py; the Redis index against a real server is in
test_redis_tier.py."""

from __future__ import annotations

from collections.abc import Callable

import redis
from tests.tiers.test_remote_index import Clock, K

from kvoffload.core.keys import ChunkKey
from kvoffload.tiers.redis_client import key_name
from kvoffload.tiers.redis_index import RedisExistence, RedisIndex
from kvoffload.tiers.redis_tier import REDIS
from kvoffload.tiers.remote_index import RemoteIndex, RemoteIndexOptions

DIGEST = bytes(range(16))


class FakeClient:
    """Holds ``held`` value names; each pipeline ``execute`` takes ``latency`` seconds
    of the fake clock, raises ``error`` when set, and runs ``during`` first (a caller
    acting while the probe is on the wire)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.held: set[str] = set()
        self.latency = 0.0001
        self.error: Exception | None = None
        self.during: Callable[[], None] | None = None
        self.probes: list[list[str]] = []  # the value names each probe asked about
        self.commands: list[list[tuple[str, ...]]] = []  # and its EXISTS commands

    def hold(self, *keys: ChunkKey, ranks: int = 1) -> None:
        self.held.update(key_name(DIGEST, k, r) for k in keys for r in range(ranks))

    def pipeline(self, transaction: bool = False) -> FakePipeline:
        assert not transaction
        return FakePipeline(self)


class FakePipeline:
    def __init__(self, client: FakeClient) -> None:
        self.client = client
        self.commands: list[tuple[str, ...]] = []

    def exists(self, *names: str) -> None:
        self.commands.append(names)

    def execute(self) -> list[int]:
        c = self.client
        c.probes.append([n for names in self.commands for n in names])
        c.commands.append(self.commands)
        if c.during is not None:
            during, c.during = c.during, None
            during()
        c.clock.now += c.latency
        if c.error is not None:
            raise c.error
        return [sum(n in c.held for n in names) for names in self.commands]  # EXISTS counts


def make(world_size: int = 1) -> tuple[RedisIndex, FakeClient, Clock]:
    clock = Clock()
    client = FakeClient(clock)
    options = RemoteIndexOptions(clock=clock, background=False)
    return RedisIndex(client, DIGEST, world_size, options), client, clock


def test_the_redis_index_is_a_remote_index_under_the_tier_s_name() -> None:
    index, client, _ = make(world_size=2)
    assert isinstance(index, RemoteIndex) and isinstance(index.query, RedisExistence)
    assert index.name == REDIS.name and index.metrics.fixed == {"tier": REDIS.name}
    assert (index.client, index.digest, index.world_size) == (client, DIGEST, 2)


def test_a_chunk_is_present_when_every_rank_s_share_exists() -> None:
    index, client, _ = make(world_size=2)
    client.hold(K(1), K(2), ranks=2)
    client.hold(K(3), ranks=1)  # rank 1's share is missing: not present
    keys = [K(1), K(2), K(3), K(4)]
    assert index.present_run(keys) == 2
    assert client.commands == [[tuple(key_name(DIGEST, k, r) for r in (0, 1)) for k in keys]]
    assert RedisExistence(client, DIGEST, 2).exists(keys) == [True, True, False, False]


def test_a_client_error_is_a_miss() -> None:
    index, client, _ = make()
    client.error = redis.ConnectionError("refused")
    assert index.present_run([K(1)]) == 0 and index.query_errors == 1
