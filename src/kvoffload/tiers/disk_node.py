"""The disk tier shared by every engine of a node that names one ``disk_path``
(decision 0017): what the disk tier says of its share, for the build
(:mod:`kvoffload.tiers.build`, :mod:`kvoffload.tiers.node_shares`) to open it as it
opens any node-shared tier. Used when ``disk_share`` says so (``node``; ``auto``,
the default: when the engine also names a ``host_share``).

The namespace directory's slots are booked by a node process of their own (a *disk
share*, over the disk slab files: :class:`~kvoffload.tiers.disk_backing.DiskBacking`),
started by whichever engine process needs it first and kept when engines leave, so
that one directory serves every engine and a restarted engine is warm:

- :func:`node_share` says where (the share's name derives from ``disk_path`` and the
  namespace; its runtime files live under ``host_share_root``), with the disk's own
  rules: while any process of a disk share's engine lives it holds the namespace's
  :class:`~kvoffload.tiers.disk_lock.ShareEngineHold` (no private engine takes the
  namespace, even while the share's node process is down); a private engine holding
  the namespace is a ``ConfigError`` naming its pid; the share's chunks and ranks
  must be this engine's (a differing ``disk_bytes`` is accepted: the share keeps its
  creator's geometry); the namespace's record is written once the directory opens;
- :func:`open_shared_store`: a worker's rank slab, opened as it is (``attach``: the
  node process owns the file's shape), with its lease on the engine's session
  (:class:`SharedDiskTierStore`).

Every read verifies the chunk's header and checksum (:mod:`kvoffload.tiers.disk`),
so a slot another engine's crash left half-written is a counted miss, never data.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from kvoffload.core.config.sections import OptionValues
from kvoffload.core.errors import ConfigError
from kvoffload.core.private_files import resolve_group
from kvoffload.share.meta import ShareGeometry
from kvoffload.tiers.disk import DiskStore
from kvoffload.tiers.disk_backing import DiskBacking
from kvoffload.tiers.disk_lock import ShareEngineHold, check_workers_engine, holder_of, in_use
from kvoffload.tiers.disk_store import DiskTierStore
from kvoffload.tiers.node_shares import NodeLease, NodeShare, serve_share
from kvoffload.tiers.spec import TierContext


def node_share(config: OptionValues, ctx: TierContext) -> NodeShare:
    """The disk share of ``disk_path`` and the engine's namespace (see the module
    docstring)."""
    from kvoffload.tiers.disk_record import DISK_RECORDS
    from kvoffload.tiers.namespace_records import record_namespace

    backing = DiskBacking(Path(config.option("disk_path")), ctx.namespace.digest())
    return disk_share(
        backing,
        share_root=Path(str(config.option("host_share_root"))),
        group=resolve_group(config.option("host_share_group")),
        geometry=ShareGeometry(ctx.slots, ctx.chunk_bytes, ctx.world_size, ctx.eviction),
        timeout_s=float(config.option("host_share_timeout_ms")) / 1000,
        after_open=lambda: record_namespace(DISK_RECORDS, backing.root, ctx.namespace),
    )


def _nothing() -> None:
    return None


def disk_share(
    backing: DiskBacking,
    *,
    share_root: Path,
    geometry: ShareGeometry,
    timeout_s: float,
    group: int | None = None,
    after_open: Callable[[], None] = _nothing,
) -> NodeShare:
    """The disk share of ``backing``, its runtime files under ``share_root`` (trusted
    to ``group`` too), created with ``geometry`` if this engine creates it (see the
    module docstring for its rules)."""
    paths = backing.paths(share_root, group)

    def engine_hold() -> Callable[[], None]:
        return ShareEngineHold.acquire(backing.root, backing.namespace).release

    def refuse() -> None:
        holder = holder_of(backing.root, backing.namespace)
        if holder is not None and holder.share != paths.name:
            raise in_use(backing.root, holder)

    def check(recorded: ShareGeometry) -> None:
        _check_layout(backing, recorded, geometry)

    return NodeShare(
        backing,
        paths,
        geometry,
        timeout_s=timeout_s,
        what=f"the disk share {paths.name} of {backing.root}",
        holds=(engine_hold,),
        refuse=refuse,
        check=check,
        after_open=after_open,
    )


def _check_layout(backing: DiskBacking, recorded: ShareGeometry, wanted: ShareGeometry) -> None:
    """The share's chunks and ranks are this engine's, else a :class:`ConfigError`."""
    if (recorded.slot_bytes, recorded.ranks) == (wanted.slot_bytes, wanted.ranks):
        return
    name = backing.share_name()
    raise ConfigError(
        "disk_path",
        f"the disk share {name} of {backing.root} holds chunks of {recorded.slot_bytes} B "
        f"per rank for {recorded.ranks} rank(s); this engine's are {wanted.slot_bytes} B "
        f"for {wanted.ranks} rank(s): stop its engines and `kvoffload share stop {name}` "
        "to change its layout, or use another disk_path",
    )


class SharedDiskTierStore(DiskTierStore):
    """A worker's rank slab of a disk share, and its hold on the share
    (:class:`~kvoffload.tiers.node_shares.NodeLease`: the lease on the engine's
    session). Reads and writes as :class:`DiskTierStore`."""

    def __init__(self, store: DiskStore, node: NodeLease) -> None:
        super().__init__(store)
        self.node = node

    def hold(self, session: bytes | None) -> None:
        """Lease ``session`` (from a plan's metadata) before any job of the plan runs;
        a later session (the scheduler half restarted) replaces the old one."""
        self.node.hold(session)

    def close(self) -> None:
        """Close the slab, then the lease and holds (the copies are over). Never raises."""
        super().close()
        self.node.close()


def open_shared_store(
    config: OptionValues, ctx: TierContext, share: NodeShare
) -> SharedDiskTierStore:
    """Rank ``ctx.rank``'s slab of the disk share, started if no node process serves
    it (ConfigError naming ``disk_path`` when it cannot be, or the chunks differ)."""
    geometry = serve_share(share).geometry
    backing = share.backing
    assert isinstance(backing, DiskBacking)
    check_workers_engine(backing.root, backing.namespace, share=share.paths.name)
    node = NodeLease(share)
    try:
        store = DiskStore(
            backing.root, backing.namespace, ctx.rank, ctx.chunk_bytes, geometry.num_slots,
            o_direct=config.option("disk_o_direct"), groups=ctx.groups, attach=True,
        )  # fmt: skip
    except BaseException:
        node.close()
        raise
    return SharedDiskTierStore(store, node)
