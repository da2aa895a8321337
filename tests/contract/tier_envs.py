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
from kvoffload.sealing import policy as seal_policy
from kvoffload.sealing.keyfile import write_new
from kvoffload.sealing.policy import load_keys
from kvoffload.sealing.sealer import Sealer
from kvoffload.sealing.store import SealedStore
from kvoffload.testing.redis_server import RedisServer
from kvoffload.tiers.build import kept_size
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
    sealed: bool = False  # opened for sealed chunks, its stores wrapped (decision 0024)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def index(self) -> LowerTier:
        return self.opened.index

    def context(self, rank: int = 0) -> TierContext:
        size = kept_size(self.config, self.spec, PAYLOAD)
        slots = self.spec.slots(self.config, size, WORLD)
        return TierContext(NAMESPACE, WORLD, size, slots, GROUPS, rank=rank)

    def store(self, rank: int = 0) -> TierStore:
        opened = self.spec.open_store(self.config, self.context(rank))
        if self.sealed:
            keys = load_keys(self.config)
            assert keys is not None
            opened = SealedStore(
                opened, Sealer(keys), chunk_bytes=PAYLOAD, namespace=NAMESPACE.digest(),
                rank=rank, groups=GROUPS,
            )  # fmt: skip
        self.stores.append(opened)
        return opened

    def inner(self, store: TierStore) -> Any:
        """The tier's own store under a sealed one."""
        return store.inner if isinstance(store, SealedStore) else store

    def close(self) -> None:
        for store in self.stores:
            close = getattr(store, "close", None)
            if close is not None:
                close()
        self.opened.close()


def _flip_disk_byte(store: Any, key: ChunkKey, slot: int) -> None:
    disk = (store.inner if isinstance(store, SealedStore) else store).store
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
            name = (store.inner if isinstance(store, SealedStore) else store).name(key)
            value = bytearray(raw.get(name))
            value[-1] ^= 0xFF
            raw.set(name, bytes(value))

        yield {"redis_url": server.url}, damage


Setup = Callable[[Path], AbstractContextManager[tuple[dict[str, Any], Damage]]]
SETUPS: dict[str, Setup] = {"disk": disk_setup, "redis": redis_setup}


SEAL_OPTIONS: dict[str, dict[str, Any]] = {"disk": {"disk_seal": True}, "redis": {}}
"""What a tier's options add, besides ``seal_key_file``, for it to be sealed."""


def seal_key_file(tmp: Path) -> str:
    """A fresh key file in ``tmp`` (owner-only, as kvoffload requires)."""
    path = tmp / "seal.key"
    write_new(path)
    return str(path)


@contextmanager
def open_env(spec: TierSpec, tmp: Path, *, sealed: bool = False) -> Iterator[TierEnv]:
    """The tier ``spec`` opened in ``tmp`` (its setup's options, the index by its
    spec; ``sealed``: with a key file and the tier's seal options), closed after."""
    setup = SETUPS.get(spec.name)
    assert setup is not None, f"tier {spec.name!r} has no contract setup in tier_envs.SETUPS"
    with setup(tmp) as (tier_options, damage):
        options = dict(tier_options)
        if sealed:
            options.update(SEAL_OPTIONS[spec.name], seal_key_file=seal_key_file(tmp))
        config = OffloadConfig.from_dict({"cpu_bytes": 1 << 20, **options})
        assert spec.enabled(config), f"the setup of {spec.name!r} does not turn it on"
        assert seal_policy.sealed(config, spec) is sealed
        size = kept_size(config, spec, PAYLOAD)
        slots = spec.slots(config, size, WORLD)
        ctx = TierContext(NAMESPACE, WORLD, size, slots, GROUPS)
        env = TierEnv(spec, config, spec.open_index(config, ctx), damage, sealed=sealed)
        try:
            yield env
        finally:
            env.close()
