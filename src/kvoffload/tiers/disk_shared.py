"""The disk tier shared by every engine of a node that names one ``disk_path``
(decision 0017): used when ``disk_share`` says so (``node``; ``auto``, the default:
when the engine also names a ``host_share``).

The namespace directory's slots are booked by a node process of their own (a *disk
share*: the host share's server, sessions, fencing and index, over the disk slab
files, see :mod:`kvoffload.tiers.disk_backing`), started by whichever engine process
needs it first and kept when engines leave, so that one directory serves every
engine and a restarted engine is warm:

- the scheduler half's index is a :class:`~kvoffload.core.tiering.lower.DirectoryTier`
  over the disk share's :class:`~kvoffload.share.client.ShareDirectory` (tier
  ``disk``), booking under the engine's session (its host share's, or one the
  scheduler half draws: :attr:`~kvoffload.tiers.spec.TierContext.session`), so
  that a killed engine's stores in flight are freed, never made readable, and its
  pins dropped;
- each worker's store (:class:`SharedDiskTierStore`) opens its rank's slab as it
  is (``attach``: the node process owns the file's shape) and holds a lease on the
  engine's session from the first plan that names it until the store is closed,
  after its copies.

Every read verifies the chunk's header and checksum (:mod:`kvoffload.tiers.disk`),
so a slot another engine's crash left half-written is a counted miss, never data.
Ownership: the scheduler half owns its directory client (closed with the tier), each
worker its store and lease.
"""

from __future__ import annotations

from pathlib import Path
from typing import cast

from kvoffload.core.config.sections import OptionValues
from kvoffload.core.directory import Directory
from kvoffload.core.errors import ConfigError
from kvoffload.core.private_files import resolve_group
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.opening import SessionLease
from kvoffload.tiers.disk import DiskStore
from kvoffload.tiers.disk_backing import DiskBacking
from kvoffload.tiers.disk_lock import check_workers_engine
from kvoffload.tiers.disk_opening import (
    ensure_disk_share,
    open_disk_share_directory,
    open_disk_share_lease,
)
from kvoffload.tiers.disk_store import DiskTierStore
from kvoffload.tiers.spec import OpenedIndex, TierContext

START_WAIT_S = 30.0
"""How long an engine start waits for the disk share's node process to listen."""


def _backing(config: OptionValues, ctx: TierContext) -> DiskBacking:
    return DiskBacking(Path(config.option("disk_path")), ctx.namespace.digest())


def _share_root(config: OptionValues) -> Path:
    return Path(str(config.option("host_share_root")))


def _share_group(config: OptionValues) -> int | None:
    """The ``host_share_group`` trusted with the disk share's runtime files."""
    return resolve_group(config.option("host_share_group"))


def _timeout_s(config: OptionValues) -> float:
    return float(config.option("host_share_timeout_ms")) / 1000


def open_shared_index(config: OptionValues, ctx: TierContext) -> OpenedIndex:
    """The scheduler half's disk tier: the disk share's directory, booked under the
    engine's session (ConfigError naming ``disk_path`` when the share cannot be
    opened or the engine's chunks do not fit it)."""
    from kvoffload.core.tiering.lower import DirectoryTier

    if ctx.session is None:
        raise ConfigError("disk_share", "a shared disk tier needs the engine's session")
    directory = open_disk_share_directory(
        _share_root(config),
        _backing(config, ctx),
        num_slots=ctx.slots,
        chunk_bytes=ctx.chunk_bytes,
        ranks=ctx.world_size,
        policy=ctx.eviction,
        session=ctx.session,
        timeout_s=_timeout_s(config),
        wait_s=START_WAIT_S,
        group=_share_group(config),
    )
    # The share's client offers the Directory interface (a miss or no_room when a call
    # is not answered); the tier planner books through it as through a private one.
    return OpenedIndex(DirectoryTier(cast(Directory, directory)), directory.close)


class SharedDiskTierStore(DiskTierStore):
    """A worker's rank slab of a disk share, and its lease on the engine's session
    (see the module docstring). Reads and writes as :class:`DiskTierStore`."""

    def __init__(
        self, store: DiskStore, share_root: Path, backing: DiskBacking, group: int | None = None
    ) -> None:
        super().__init__(store)
        self.lease = SessionLease(
            lambda session: open_disk_share_lease(share_root, backing, session, group)
        )

    def hold(self, session: bytes | None) -> None:
        """Lease ``session`` (from a plan's metadata) before any job of the plan runs;
        a later session (the scheduler half restarted) replaces the old one."""
        self.lease.hold(session)

    def close(self) -> None:
        """Close the slab, then the lease (the copies are over). Never raises."""
        super().close()
        self.lease.close()


def open_shared_store(config: OptionValues, ctx: TierContext) -> SharedDiskTierStore:
    """Rank ``ctx.rank``'s slab of the disk share, started if no node process serves
    it (ConfigError naming ``disk_path`` when it cannot be, or the chunks differ)."""
    root, backing, group = _share_root(config), _backing(config, ctx), _share_group(config)
    wanted = ShareGeometry(ctx.slots, ctx.chunk_bytes, ctx.world_size, ctx.eviction)
    geometry = ensure_disk_share(root, backing, wanted, START_WAIT_S, group)
    check_workers_engine(backing.root, backing.namespace, share=backing.share_name())
    store = DiskStore(
        backing.root,
        backing.namespace,
        ctx.rank,
        ctx.chunk_bytes,
        geometry.num_slots,
        o_direct=config.option("disk_o_direct"),
        groups=ctx.groups,
        attach=True,
    )
    return SharedDiskTierStore(store, root, backing, group)
