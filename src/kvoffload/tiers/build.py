"""The one place the lower tiers are built, from their specs (``tiers/registry.py``):

- :func:`tier_slots`: each enabled tier's capacity in chunks (the vLLM adapter's
  geometry, both halves alike);
- :func:`open_lower_tiers`: the scheduler half's indexes, opened in the registry's
  order (:class:`LowerTiers`, closed once at shutdown);
- :func:`open_tier_stores`: one worker's stores, by tier name;
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
from typing import TYPE_CHECKING

from kvoffload.tiers.registry import TIERS
from kvoffload.tiers.spec import OpenedIndex, TierContext, TierSpec, TierStore

if TYPE_CHECKING:
    from kvoffload.core.config.typed import OffloadConfig
    from kvoffload.core.directory import Directory
    from kvoffload.core.identity.weights import WeightsState
    from kvoffload.core.keys import Namespace
    from kvoffload.core.scheduler import OffloadScheduler
    from kvoffload.core.scheduler_types import SchedulerConfig
    from kvoffload.core.tiering.lower import DirectoryTier, LowerTier


def _random_epoch() -> bytes:
    return os.urandom(16)


def enabled_tiers(config: OffloadConfig) -> tuple[TierSpec, ...]:
    """The tiers ``config`` turns on, in the registry's order."""
    return tuple(spec for spec in TIERS if spec.enabled(config))


def tier_slots(config: OffloadConfig, chunk_bytes: int, world_size: int) -> dict[str, int]:
    """Each enabled tier's capacity in chunks of ``chunk_bytes`` per rank (0: keyed
    by chunk, unbounded here); ``ConfigError`` when a tier holds not even one."""
    return {
        spec.name: spec.slots(config, chunk_bytes, world_size) for spec in enabled_tiers(config)
    }


@dataclass
class LowerTiers:
    """The scheduler half's opened lower tiers, in order; one owner (the adapter's
    scheduler role), which calls :meth:`close` once."""

    opened: list[tuple[TierSpec, OpenedIndex]] = field(default_factory=list)

    @property
    def indexes(self) -> list[LowerTier]:
        return [opened.index for _, opened in self.opened]

    def index(self, name: str) -> LowerTier | None:
        """The index of tier ``name`` (None: not enabled)."""
        for spec, opened in self.opened:
            if spec.name == name:
                return opened.index
        return None

    def replace(self, name: str, opened: OpenedIndex) -> LowerTier:
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


def open_lower_tiers(
    config: OffloadConfig,
    namespace: Namespace,
    *,
    world_size: int,
    chunk_bytes: int,
    slots: Mapping[str, int],
    groups: int = 1,
    session: bytes | None = None,
) -> LowerTiers:
    """Open every enabled tier's index (``slots``: from :func:`tier_slots`;
    ``session``: the engine's session at its host share, if it names one)."""
    tiers = LowerTiers()
    try:
        for spec in enabled_tiers(config):
            ctx = TierContext(
                namespace,
                world_size,
                chunk_bytes,
                slots.get(spec.name, 0),
                groups=groups,
                eviction=config.eviction,
                session=session,
            )
            tiers.opened.append((spec, spec.open_index(config, ctx)))
    except BaseException:
        tiers.close()
        raise
    return tiers


def open_tier_stores(
    config: OffloadConfig,
    namespace: Namespace,
    *,
    rank: int,
    world_size: int,
    chunk_bytes: int,
    slots: Mapping[str, int],
    groups: int = 1,
) -> dict[str, TierStore]:
    """Rank ``rank``'s store of every enabled tier, by name (empty: no lower tier).
    A store booked at a node process (:class:`~kvoffload.tiers.spec.SessionHolder`)
    must be given each plan's session before its jobs run."""
    stores: dict[str, TierStore] = {}
    try:
        for spec in enabled_tiers(config):
            ctx = TierContext(
                namespace,
                world_size,
                chunk_bytes,
                slots.get(spec.name, 0),
                groups,
                eviction=config.eviction,
                rank=rank,
            )
            stores[spec.name] = spec.open_store(config, ctx)
    except BaseException:
        for store in stores.values():
            close = getattr(store, "close", None)
            if close is not None:
                close()
        raise
    return stores


def directory_tiers(slots: Mapping[str, int], policy: str) -> list[DirectoryTier]:
    """Lower tiers booked in in-memory directories: one per name with a capacity
    (> 0), known tiers in the registry's order, then any other names in order."""
    from kvoffload.core.directory import Directory
    from kvoffload.core.tiering.lower import DirectoryTier

    order = {spec.name: i for i, spec in enumerate(TIERS)}
    names = sorted((n for n in slots if slots[n] > 0), key=lambda n: order.get(n, len(order)))
    return [DirectoryTier(Directory(slots[n], tier=n, policy=policy)) for n in names]


def build_scheduler(
    settings: SchedulerConfig,
    host: Directory,
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
