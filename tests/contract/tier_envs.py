"""Each lower tier of the registry as the tier contract suite meets it: its
scheduler-side index and one rank's worker-side store, both built by the tier's own
spec (``TierSpec.open_index`` / ``open_store``) from a configuration that turns the
tier on, and a way to damage a stored chunk the way its medium can (a flipped byte in
a disk slot, a Redis value overwritten).

A tier added to ``tiers/registry.py`` needs an entry in :data:`SETUPS` (the options
that turn it on in a test, and its damage); the suite fails for a registered tier
without one."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvoffload.core.config.typed import OffloadConfig
from kvoffload.core.keys import ChunkKey, Namespace
from kvoffload.core.tiering.lower import LowerTier
from kvoffload.testing.redis_server import RedisServer
from kvoffload.tiers.disk import PAYLOAD_OFFSET, slot_bytes
from kvoffload.tiers.spec import OpenedIndex, TierContext, TierSpec, TierStore

NAMESPACE = Namespace(model="contract@test", layout="layout", dtype="fp16")
PAYLOAD = 4096
SLOTS = 8
GROUPS = 2  # the layout's KV cache groups: chunks of group 0 and 1
WORLD = 2  # ranks: stores of rank 0 and 1


Damage = Callable[[TierStore, ChunkKey, int], None]
"""Make the chunk ``key`` (at tier slot ``slot``) that ``store`` wrote fail to verify."""


@dataclass
class TierEnv:
    """One tier opened for a test: ``index`` (scheduler half), ``stores`` (one per
    rank opened so far, by :meth:`store`), and its medium's damage."""

    spec: TierSpec
    config: OffloadConfig
    opened: OpenedIndex
    damage: Damage
    stores: list[TierStore] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def index(self) -> LowerTier:
        return self.opened.index

    def context(self, rank: int = 0) -> TierContext:
        slots = self.spec.slots(self.config, PAYLOAD, WORLD)
        return TierContext(NAMESPACE, WORLD, PAYLOAD, slots, GROUPS, rank=rank)

    def store(self, rank: int = 0) -> TierStore:
        opened = self.spec.open_store(self.config, self.context(rank))
        self.stores.append(opened)
        return opened

    def close(self) -> None:
        for store in self.stores:
            close = getattr(store, "close", None)
            if close is not None:
                close()
        self.opened.close()


def _flip_disk_byte(store: Any, key: ChunkKey, slot: int) -> None:
    disk = store.store
    with open(disk.path, "r+b") as f:
        f.seek(disk.offset(slot) + PAYLOAD_OFFSET)
        byte = f.read(1)
        f.seek(disk.offset(slot) + PAYLOAD_OFFSET)
        f.write(bytes([byte[0] ^ 0xFF]))


@contextmanager
def disk_setup(tmp: Path) -> Iterator[tuple[dict[str, Any], Damage]]:
    options = {"disk_path": str(tmp / "disk"), "disk_bytes": SLOTS * WORLD * slot_bytes(PAYLOAD)}
    yield options, _flip_disk_byte


@contextmanager
def redis_setup(tmp: Path) -> Iterator[tuple[dict[str, Any], Damage]]:
    with RedisServer(tmp).start() as server:

        def damage(store: Any, key: ChunkKey, slot: int) -> None:
            raw = server.client()
            name = store.name(key)
            value = bytearray(raw.get(name))
            value[-1] ^= 0xFF
            raw.set(name, bytes(value))

        yield {"redis_url": server.url}, damage


Setup = Callable[[Path], AbstractContextManager[tuple[dict[str, Any], Damage]]]
SETUPS: dict[str, Setup] = {"disk": disk_setup, "redis": redis_setup}


@contextmanager
def open_env(spec: TierSpec, tmp: Path) -> Iterator[TierEnv]:
    """The tier ``spec`` opened in ``tmp`` (its setup's options, the index by its
    spec), closed after."""
    setup = SETUPS.get(spec.name)
    assert setup is not None, f"tier {spec.name!r} has no contract setup in tier_envs.SETUPS"
    with setup(tmp) as (options, damage):
        config = OffloadConfig.from_dict({"cpu_bytes": 1 << 20, **options})
        assert spec.enabled(config), f"the setup of {spec.name!r} does not turn it on"
        slots = spec.slots(config, PAYLOAD, WORLD)
        ctx = TierContext(NAMESPACE, WORLD, PAYLOAD, slots, GROUPS)
        env = TierEnv(spec, config, spec.open_index(config, ctx), damage)
        try:
            yield env
        finally:
            env.close()
