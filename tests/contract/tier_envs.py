"""Each lower tier as the tier contract suite meets it: its scheduler-side index, one
rank's worker-side store, and a way to damage a stored chunk the way its medium can
(a flipped byte in a disk slot, a Redis value overwritten). One environment per tier
name (``ENVS``): a context manager that opens it and closes it after."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvoffload.core.tiering import LowerTier
from kvoffload.testing.redis_server import RedisServer
from kvoffload.tiers.disk import PAYLOAD_OFFSET, DiskStore
from kvoffload.tiers.disk_index import open_disk_tier
from kvoffload.tiers.disk_store import DiskTierStore
from kvoffload.tiers.redis_client import RedisSettings, make_client
from kvoffload.tiers.redis_index import RedisIndex
from kvoffload.tiers.redis_store import RedisStore
from kvoffload.transfer.tier_worker import TierStore

DIGEST = bytes(range(16))
PAYLOAD = 4096
SLOTS = 8
GROUPS = 2  # the layout's KV cache groups: chunks of group 0 and 1


@dataclass
class TierEnv:
    """One tier opened for a test: ``index`` (scheduler half), ``stores`` (one per
    rank opened so far, by :meth:`store`), and its medium's damage."""

    name: str
    index: LowerTier
    open_store: Any  # rank -> TierStore
    damage: Any  # (store, key, slot) -> None: the stored chunk no longer verifies
    stores: list[TierStore] = field(default_factory=list)

    def store(self, rank: int = 0) -> TierStore:
        opened: TierStore = self.open_store(rank)
        self.stores.append(opened)
        return opened


@contextmanager
def disk_env(tmp: Path) -> Iterator[TierEnv]:
    index, _ = open_disk_tier(tmp, DIGEST, 1, SLOTS, PAYLOAD)

    def open_store(rank: int) -> TierStore:
        return DiskTierStore(DiskStore(tmp, DIGEST, rank, PAYLOAD, SLOTS, groups=GROUPS))

    def damage(store: Any, key: object, slot: int) -> None:
        disk: DiskStore = store.store
        with open(disk.path, "r+b") as f:
            f.seek(disk.offset(slot) + PAYLOAD_OFFSET)
            byte = f.read(1)
            f.seek(disk.offset(slot) + PAYLOAD_OFFSET)
            f.write(bytes([byte[0] ^ 0xFF]))

    env = TierEnv("disk", index, open_store, damage)
    try:
        yield env
    finally:
        for store in env.stores:
            store.close()  # type: ignore[attr-defined]


@contextmanager
def redis_env(tmp: Path) -> Iterator[TierEnv]:
    with RedisServer(tmp).start() as server:
        client = make_client(RedisSettings(server.url))
        index = RedisIndex(client, DIGEST, 1, background=False)

        def open_store(rank: int) -> TierStore:
            return RedisStore(make_client(RedisSettings(server.url)), DIGEST, rank, PAYLOAD, GROUPS)

        def damage(store: Any, key: Any, slot: int) -> None:
            raw = server.client()
            name = store.name(key)
            value = bytearray(raw.get(name))
            value[-1] ^= 0xFF
            raw.set(name, bytes(value))

        env = TierEnv("redis", index, open_store, damage)
        try:
            yield env
        finally:
            index.close()  # type: ignore[attr-defined]


ENVS = {"disk": disk_env, "redis": redis_env}
