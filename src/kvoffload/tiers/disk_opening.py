"""Opening a disk share (the disk tier shared by the engines of a node,
:mod:`.disk_backing`) from an engine.

The scheduler half calls :func:`open_disk_share_directory` (the tier's directory, of
tier ``"disk"``), each worker :func:`ensure_disk_share` (before it attaches its
rank's slab: ``DiskStore(..., attach=True)``) and :func:`open_disk_share_lease` on
its engine's session; whichever runs first starts the share's node process. These
are start-up calls: they may wait up to ``wait_s`` for it.

Every refusal is a :class:`ConfigError` naming ``disk_path``: a private engine holds
the namespace (the message names its pid), the share's chunks or ranks differ from
this engine's, or its node process did not start (the message gives the last line it
logged). A differing ``disk_bytes`` is accepted: the share keeps the geometry it was
created with (its first engine's).

The directory and the lease also hold, until closed, the namespace's
:class:`~kvoffload.tiers.disk_lock.ShareEngineHold`: while any process of a disk
share's engine lives, no private engine takes the namespace, even while the share's
node process is down (its engines may still be writing into the slabs).
"""

from __future__ import annotations

from pathlib import Path

from kvoffload.core.errors import ConfigError
from kvoffload.share.client import ShareDirectory
from kvoffload.share.lease import Lease
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.opening import NotStarted, start_and_wait
from kvoffload.share.paths import SharePaths
from kvoffload.share.users import UsersHold
from kvoffload.tiers.disk_backing import DiskBacking
from kvoffload.tiers.disk_lock import ShareEngineHold, holder_of, in_use


def ensure_disk_share(
    share_root: Path,
    backing: DiskBacking,
    geometry: ShareGeometry,
    wait_s: float,
    group: int | None = None,
) -> ShareGeometry:
    """Start the disk share's node process (with ``geometry``, if it creates the share)
    unless one serves it, wait until one does, and return the share's recorded
    geometry; a :class:`ConfigError` naming ``disk_path`` with the reason otherwise."""
    paths = backing.paths(share_root, group)
    _refuse_private_holder(paths, backing)
    recorded = start_and_wait(paths, geometry, wait_s, backing)
    if not isinstance(recorded, NotStarted):
        return recorded
    _refuse_private_holder(paths, backing)
    raise recorded.error("disk_path", f"the disk share {paths.name} of {backing.root}")


def open_disk_share_directory(
    share_root: Path,
    backing: DiskBacking,
    *,
    num_slots: int,
    chunk_bytes: int,
    ranks: int,
    policy: str,
    session: bytes,
    timeout_s: float,
    wait_s: float = 30.0,
    group: int | None = None,
) -> ShareDirectory:
    """The scheduler half's directory of the disk share: tier ``"disk"``, namespace
    label ``backing.namespace`` (``reset`` drops this namespace's chunks), session
    ``session`` (its workers' leases hold it open). ``num_slots``, ``chunk_bytes`` (per
    rank), ``ranks`` and ``policy`` are the share's geometry if this engine creates
    it; its chunk bytes and ranks must equal the share's. ``group``: the
    ``host_share_group`` trusted with its runtime files (None: this user only)."""
    hold = ShareEngineHold.acquire(backing.root, backing.namespace)
    try:
        wanted = ShareGeometry(num_slots, chunk_bytes, ranks, policy)
        recorded = ensure_disk_share(share_root, backing, wanted, wait_s, group)
        _check_layout(backing, recorded, wanted)
        directory = ShareDirectory(
            backing.paths(share_root, group), geometry=recorded, session=session,
            namespace=backing.namespace, tier="disk", timeout_s=timeout_s, backing=backing,
        )  # fmt: skip
    except BaseException:
        hold.release()
        raise
    directory.on_close.append(hold.release)
    directory.wait_ready(wait_s)
    return directory


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


def open_disk_share_lease(
    share_root: Path, backing: DiskBacking, session: bytes, group: int | None = None
) -> Lease:
    """A worker's lease on its engine's session (close it when the worker ends); it
    holds the namespace's :class:`ShareEngineHold` and the disk share's
    ``users.lock`` (:class:`~kvoffload.share.users.UsersHold`: ``kvoffload share
    remove`` refuses while it is held) until closed."""
    paths = backing.paths(share_root, group)
    hold = ShareEngineHold.acquire(backing.root, backing.namespace)
    try:
        users = UsersHold(paths)
    except BaseException:
        hold.release()
        raise
    lease = Lease(paths, session, users=users)
    lease.on_close += [users.release, hold.release]
    return lease


def _refuse_private_holder(paths: SharePaths, backing: DiskBacking) -> None:
    """A :class:`ConfigError` naming ``disk_path`` and the holder's pid when something
    other than this share's node process holds the namespace's lock."""
    holder = holder_of(backing.root, backing.namespace)
    if holder is not None and holder.share != paths.name:
        raise in_use(backing.root, holder)
