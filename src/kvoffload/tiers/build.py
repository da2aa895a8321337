"""The one place tiers are built, from their specs (``tiers/registry.py``):

- :func:`open_directory` and :func:`open_store`: where a tier's directory lives, in
  the engine or in a node process over a backing (the spec's
  :attr:`~kvoffload.tiers.spec.TierSpec.node_share`), chosen here once for every
  tier, host memory included, and one worker's store of it;
- :func:`tier_slots`: each enabled lower tier's capacity in chunks (the vLLM
  adapter's geometry, both halves alike);
- :func:`open_engine_tiers`: the scheduler half's tiers (host memory's directory,
  then the lower tiers' indexes in the registry's order, and the engine's session
  at the node processes that keep any of them: :class:`EngineTiers`, closed once at
  shutdown);
- :func:`open_host_slots`, :func:`open_tier_stores`: one worker's host slots and
  lower tiers' stores;
- :func:`directory_tiers`: tiers booked in in-memory directories, by name and
  capacity, for the simulator and the reference engine (their bytes live in the
  simulated or manual worker);
- :func:`build_scheduler`: the scheduler half over a host directory and those lower
  tiers, as the adapter, the simulator and the reference engine all build it.

A tier that fails to open (``ConfigError``: refused configuration, a namespace held
by another engine) closes every tier opened before it, then raises.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from kvoffload.tiers.registry import HOST, LOWER_TIERS
from kvoffload.tiers.spec import OpenedIndex, TierContext, TierSpec, TierStore

if TYPE_CHECKING:
    from kvoffload.core.config.typed import OffloadConfig
    from kvoffload.core.directory import HostDirectory
    from kvoffload.core.identity.weights import WeightsState
    from kvoffload.core.keys import Namespace
    from kvoffload.core.scheduler import OffloadScheduler
    from kvoffload.core.scheduler_types import SchedulerConfig
    from kvoffload.core.tiering.lower import DirectoryTier, LowerTier
    from kvoffload.sealing.keyfile import SealKeys
    from kvoffload.tiers.node_shares import OpenedShare
    from kvoffload.tiers.record_log import RecordLog
    from kvoffload.tiers.slot_rows import SlotRows


I = TypeVar("I")  # noqa: E741
S = TypeVar("S")


def _nothing() -> None:
    return None


def _random_epoch() -> bytes:
    return os.urandom(16)


def enabled_tiers(config: OffloadConfig) -> tuple[TierSpec[LowerTier, TierStore], ...]:
    """The lower tiers ``config`` turns on, in the registry's order."""
    return tuple(spec for spec in LOWER_TIERS if spec.enabled(config))


def open_directory(
    spec: TierSpec[I, Any], config: OffloadConfig, ctx: TierContext
) -> tuple[OpenedIndex[I], OpenedShare | None]:
    """Tier ``spec``'s index for the scheduler half: over a directory in a node
    process when the configuration shares it (``spec.node_share``; booked under
    ``ctx.session``, which must be set then), else the tier's own; and the share
    opened (None: private). ``ConfigError`` when the tier or its share refuses."""
    share = spec.node_share(config, ctx)
    if share is None:
        return spec.open_index(config, ctx), None
    from kvoffload.tiers.node_shares import open_node_directory

    if ctx.session is None:
        raise ValueError(f"tier {spec.name}: a node-shared directory needs the engine's session")
    opened = open_node_directory(
        spec.name, share, namespace=ctx.namespace.digest(), session=ctx.session
    )
    try:
        index = spec.over_directory(opened.directory)
        share.after_open()
    except BaseException:
        opened.close()
        raise
    return OpenedIndex(index, opened.close), opened


def open_store(spec: TierSpec[Any, S], config: OffloadConfig, ctx: TierContext) -> S:
    """One worker's store of tier ``spec``: over the node process's files when the
    configuration shares the tier (the node process started if none serves it),
    else the tier's own. ``ConfigError`` when the tier or its share refuses."""
    share = spec.node_share(config, ctx)
    if share is None:
        return spec.open_store(config, ctx)
    return spec.open_shared_store(config, ctx, share)


ChunkSizes = int | Mapping[str, int]
"""One rank's chunk bytes as the tiers keep them: one size for every tier, or each
tier's by name (tiers of different codecs, decision 0023; a name missing: host
memory's)."""


def size_in(sizes: ChunkSizes, tier: str) -> int:
    """Tier ``tier``'s chunk bytes in ``sizes``."""
    if isinstance(sizes, int):
        return sizes
    return sizes.get(tier, sizes[HOST.name])


def kept_size(config: OffloadConfig, spec: TierSpec[Any, Any], chunk_bytes: ChunkSizes) -> int:
    """The bytes tier ``spec`` keeps per chunk: its chunk in ``chunk_bytes``, plus the
    seal where the configuration seals the tier (decision 0024); both halves size the
    tier with it."""
    from kvoffload.sealing.policy import stored_bytes

    return stored_bytes(config, spec, size_in(chunk_bytes, spec.name))


def tier_slots(config: OffloadConfig, chunk_bytes: ChunkSizes, world_size: int) -> dict[str, int]:
    """Each enabled tier's capacity in its chunks of ``chunk_bytes`` per rank, sealed
    where sealed (0: keyed by chunk, unbounded here); ``ConfigError`` when a tier holds
    not even one."""
    return {
        spec.name: spec.slots(config, kept_size(config, spec, chunk_bytes), world_size)
        for spec in enabled_tiers(config)
    }


@dataclass
class LowerTiers:
    """The scheduler half's opened lower tiers, in order; one owner (the adapter's
    scheduler role, through :class:`EngineTiers`), which calls :meth:`close` once."""

    opened: list[tuple[TierSpec[LowerTier, TierStore], OpenedIndex[LowerTier]]] = field(
        default_factory=list
    )

    @property
    def indexes(self) -> list[LowerTier]:
        return [opened.index for _, opened in self.opened]

    def index(self, name: str) -> LowerTier | None:
        """The index of tier ``name`` (None: not enabled)."""
        for spec, opened in self.opened:
            if spec.name == name:
                return opened.index
        return None

    def record_logs(self) -> dict[str, RecordLog]:
        """The announcement records of each tier that keeps them (``record_log.py``)."""
        return {spec.name: o.records for spec, o in self.opened if o.records is not None}

    def replace(self, name: str, opened: OpenedIndex[LowerTier]) -> LowerTier:
        """Hold ``opened`` as tier ``name``'s index from now on (harnesses swap in a
        deterministic one), closing the old one; returns the old index. KeyError
        when the tier is not open."""
        for i, (spec, old) in enumerate(self.opened):
            if spec.name == name:
                old.close()
                self.opened[i] = (spec, opened)
                return old.index
        raise KeyError(name)

    def close(self) -> None:
        """Close every tier, last opened first; each at most once."""
        while self.opened:
            _, opened = self.opened.pop()
            opened.close()


@dataclass
class EngineTiers:
    """The scheduler half's tiers, opened by :func:`open_engine_tiers`: host memory's
    directory (``host``), the lower tiers (``lower``), the engine's ``session`` at
    the node processes that keep any tier's directory (None: no tier is shared), and
    those shares by tier name (their start-up text, link counters, plans' slab id).
    One owner (the adapter's scheduler role), which calls :meth:`close` once."""

    host: OpenedIndex[HostDirectory]
    lower: LowerTiers
    session: bytes | None
    shares: dict[str, OpenedShare]

    @property
    def host_share(self) -> OpenedShare | None:
        """The host tier's share (None: private host memory)."""
        return self.shares.get(HOST.name)

    def close(self) -> None:
        """Close the lower tiers (last opened first), then host memory's directory;
        at most once."""
        self.lower.close()
        host_close, self.host.close = self.host.close, _nothing
        host_close()


def _contexts(
    config: OffloadConfig, namespace: Namespace, *, world_size: int, chunk_bytes: ChunkSizes,
    slots: Mapping[str, int], groups: int, rank: int = 0, session: bytes | None = None,
) -> Callable[[TierSpec[Any, Any]], TierContext]:  # fmt: skip
    def ctx(spec: TierSpec[Any, Any]) -> TierContext:
        return TierContext(
            namespace, world_size, kept_size(config, spec, chunk_bytes), slots.get(spec.name, 0),
            groups=groups,
            eviction=config.eviction, rank=rank, session=session,
        )  # fmt: skip

    return ctx


def open_engine_tiers(
    config: OffloadConfig,
    namespace: Namespace,
    *,
    world_size: int,
    chunk_bytes: ChunkSizes,
    slots: Mapping[str, int],
    groups: int = 1,
) -> EngineTiers:
    """Open host memory's directory, then every enabled lower tier's index (``slots``:
    each tier's capacity in chunks per rank, host memory's under ``"host"``). When
    any of them is kept by a node process the engine draws a random session first,
    which every share books under and every plan names for the workers' leases.
    A tier that refuses (``ConfigError``) closes every tier opened before it."""
    specs: list[TierSpec[Any, Any]] = [HOST, *enabled_tiers(config)]
    draft = _contexts(config, namespace, world_size=world_size, chunk_bytes=chunk_bytes,
                      slots=slots, groups=groups)  # fmt: skip
    shared = any(spec.node_share(config, draft(spec)) is not None for spec in specs)
    session = os.urandom(16) if shared else None
    ctx = _contexts(config, namespace, world_size=world_size, chunk_bytes=chunk_bytes,
                    slots=slots, groups=groups, session=session)  # fmt: skip
    shares: dict[str, OpenedShare] = {}
    host, share = open_directory(HOST, config, ctx(HOST))
    if share is not None:
        shares[HOST.name] = share
    tiers = EngineTiers(host, LowerTiers(), session, shares)
    try:
        for spec in specs[1:]:
            opened, share = open_directory(spec, config, ctx(spec))
            tiers.lower.opened.append((spec, opened))
            if share is not None:
                shares[spec.name] = share
    except BaseException:
        tiers.close()
        raise
    return tiers


def open_host_slots(
    config: OffloadConfig,
    namespace: Namespace,
    *,
    rank: int,
    world_size: int,
    chunk_bytes: int,
    slots: int,
) -> SlotRows:
    """Rank ``rank``'s host slots: its own slab of ``slots`` slots of ``chunk_bytes``,
    or its slab of the host share (a :class:`~kvoffload.tiers.host_shared.SharedHostSlab`:
    hold each plan's session and admit its slab before its jobs run). ``ConfigError``
    when it cannot be opened."""
    ctx = TierContext(namespace, world_size, chunk_bytes, slots, eviction=config.eviction,
                      rank=rank)  # fmt: skip
    slab: SlotRows = open_store(HOST, config, ctx)
    return slab


def open_tier_stores(
    config: OffloadConfig,
    namespace: Namespace,
    *,
    rank: int,
    world_size: int,
    chunk_bytes: ChunkSizes,
    slots: Mapping[str, int],
    groups: int = 1,
) -> dict[str, TierStore]:
    """Rank ``rank``'s store of every enabled lower tier, by name (empty: no lower
    tier). A store booked at a node process (:class:`~kvoffload.tiers.spec.SessionHolder`)
    must be given each plan's session before its jobs run."""
    from kvoffload.sealing.policy import load_keys, sealed

    ctx = _contexts(config, namespace, world_size=world_size, chunk_bytes=chunk_bytes,
                    slots=slots, groups=groups, rank=rank)  # fmt: skip
    keys = load_keys(config)
    stores: dict[str, TierStore] = {}
    try:
        for spec in enabled_tiers(config):
            stores[spec.name] = open_store(spec, config, ctx(spec))
            if keys is not None and sealed(config, spec):
                stores[spec.name] = _sealed(stores[spec.name], keys, ctx(spec),
                                            size_in(chunk_bytes, spec.name))  # fmt: skip
    except BaseException:
        for store in stores.values():
            close = getattr(store, "close", None)
            if close is not None:
                close()
        raise
    return stores


def _sealed(store: TierStore, keys: SealKeys, ctx: TierContext, chunk_bytes: int) -> TierStore:
    """``store`` (opened for sealed chunks) as a store of plain chunks of ``chunk_bytes``."""
    from kvoffload.sealing.sealer import Sealer
    from kvoffload.sealing.store import SealedStore

    return SealedStore(
        store, Sealer(keys), chunk_bytes=chunk_bytes, namespace=ctx.namespace.digest(),
        rank=ctx.rank, groups=ctx.groups,
    )  # fmt: skip


def directory_tiers(slots: Mapping[str, int], policy: str) -> list[DirectoryTier]:
    """Lower tiers booked in in-memory directories: one per name with a capacity
    (> 0), known tiers in the registry's order, then any other names in order."""
    from kvoffload.core.directory import Directory
    from kvoffload.core.tiering.lower import DirectoryTier

    order = {spec.name: i for i, spec in enumerate(LOWER_TIERS)}
    names = sorted((n for n in slots if slots[n] > 0), key=lambda n: order.get(n, len(order)))
    return [DirectoryTier(Directory(slots[n], tier=n, policy=policy)) for n in names]


def build_scheduler(
    settings: SchedulerConfig,
    host: HostDirectory,
    namespace: Namespace,
    lower: Iterable[LowerTier] = (),
    *,
    spill_after_hits: int = 0,
    clock: Callable[[], float] = time.monotonic,
    new_epoch: Callable[[], bytes] = _random_epoch,
    weights: WeightsState | None = None,
) -> OffloadScheduler:
    """The scheduler half over ``host`` and the ``lower`` tiers (in order); with
    ``weights``, keyed by what its workers report of their weights (decision 0019)."""
    from kvoffload.core.scheduler import OffloadScheduler

    return OffloadScheduler(
        settings,
        host,
        namespace,
        lower_tiers=list(lower),
        spill_after_hits=spill_after_hits,
        clock=clock,
        new_epoch=new_epoch,
        weights=weights,
    )
