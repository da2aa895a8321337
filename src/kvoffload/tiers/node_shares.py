"""A tier whose directory lives in a node process: the one way an engine opens one.

A tier that the engines of a node can share says, for a configuration, how its
directory is shared (its spec's :attr:`~kvoffload.tiers.spec.TierSpec.node_share`: a
:class:`NodeShare`, or None: the directory lives in the engine). The build
(:mod:`kvoffload.tiers.build`) then opens, for every such tier alike:

- in the scheduler half, :func:`open_node_directory`: the node process started
  unless one serves the share (:func:`serve_share`), the share's client
  (:class:`~kvoffload.share.client.ShareDirectory`) booking under the engine's
  session, wrapped as an :class:`OpenedShare` (its start-up text, its link's
  counters, the slab id each plan names);
- in each worker, :func:`serve_share` and a :class:`NodeLease`: the share's
  ``users.lock`` and the tier's holds for the worker's life, and a lease on the
  engine's session from the first plan that names it, before any job of that plan
  runs. The tier's own store (a disk slab, a shared-memory slab) is the spec's.

Where the slots are is the share's :class:`~kvoffload.share.backing.Backing`
(shared-memory slabs for the host tier, the disk tier's slab files for the disk
tier); what differs between tiers beyond it is said by the :class:`NodeShare`:
``holds`` (locks the tier's engines keep while any of their processes lives),
``refuse`` (a check that something other than the share's node process does not
hold the files), ``check`` (whether the share's recorded geometry fits this
engine) and ``after_open`` (what the scheduler half does once the directory is
open: e.g. write the namespace's record).

These are start-up calls: they may wait up to ``wait_s`` for the node process.
Every refusal is a :class:`~kvoffload.core.errors.ConfigError` naming the option
that chose the share. Ownership: the scheduler half owns its :class:`OpenedShare`
(closed with the tier), each worker its :class:`NodeLease`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvoffload.share.backing import Backing
from kvoffload.share.client import ShareDirectory
from kvoffload.share.feed_reader import FEED_TIMEOUT_S, FeedReader
from kvoffload.share.lease import Lease
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.opening import NotStarted, Serving, SessionLease, start_and_wait
from kvoffload.share.paths import SharePaths
from kvoffload.share.users import UsersHold

START_WAIT_S = 30.0
"""How long an engine start waits for a share's node process to listen."""

Hold = Callable[[], Callable[[], None]]
"""Takes a lock (or raises ``ConfigError``) and returns what releases it."""


def _accept(geometry: ShareGeometry) -> None:
    return None


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class NodeShare:
    """How one tier's directory is shared by the engines of a node (see the module
    docstring): ``backing`` its slots; ``paths`` its runtime files; ``geometry`` the
    one this engine creates it with (a share keeps its creator's); ``timeout_s`` one
    directory call's deadline; ``what`` the share in messages; ``bind_plans``
    whether every plan names the slab its bookings are in (slots whose identity
    changes with the node process: shared memory)."""

    backing: Backing
    paths: SharePaths
    geometry: ShareGeometry
    timeout_s: float
    what: str
    bind_plans: bool = False
    holds: tuple[Hold, ...] = ()
    refuse: Callable[[], None] = _nothing
    check: Callable[[ShareGeometry], None] = _accept
    after_open: Callable[[], None] = _nothing  # the scheduler half's, once its directory is open


def serve_share(share: NodeShare, wait_s: float = START_WAIT_S) -> Serving:
    """Start the share's node process unless one serves it, wait until one does, and
    return what it serves, checked against this engine (``share.check``); a
    :class:`ConfigError` naming the backing's option otherwise."""
    share.refuse()
    found = start_and_wait(share.paths, share.geometry, wait_s, share.backing)
    if isinstance(found, NotStarted):
        share.refuse()  # the reason may be a holder of the files: name it
        raise found.error(share.backing.config_key, share.what)
    share.check(found.geometry)
    return found


def take(holds: Sequence[Hold]) -> list[Callable[[], None]]:
    """Take every hold in order, returning their releases; a refused one releases
    those taken before it, then raises."""
    releases: list[Callable[[], None]] = []
    try:
        for hold in holds:
            releases.append(hold())
    except BaseException:
        release(releases)
        raise
    return releases


def release(releases: Sequence[Callable[[], None]]) -> None:
    """Release in reverse order of taking."""
    for undo in reversed(releases):
        undo()


@dataclass
class OpenedShare:
    """A tier's directory in a node process, opened by the scheduler half: the
    tier's name, its share, the client, and whether this process started the node
    process serving it."""

    tier: str
    share: NodeShare
    directory: ShareDirectory
    started: bool

    def describe(self) -> str:
        """The share's part of the start-up line."""
        welcome = self.directory.link.welcome
        generation = welcome.generation if welcome is not None else "?"
        pid = welcome.pid if welcome is not None else "?"
        who = "started by this engine" if self.started else "found running"
        paths = self.share.paths
        return (
            f"{self.tier} share {paths.name!r} in {paths.root} "
            f"(generation {generation}, node process pid {pid}, {who})"
        )

    def feed_reader(self) -> FeedReader:
        """A reader of the share's announcement feed under this engine's session and
        namespace, on a connection of its own (``share/feed_reader.py``)."""
        link = self.directory.link
        # Off the step path: a feed call may wait longer than the share's call deadline.
        return FeedReader(self.share.paths, link.session, link.namespace,
                          timeout_s=max(self.share.timeout_s, FEED_TIMEOUT_S))  # fmt: skip

    def link_stats(self) -> Mapping[str, int]:
        """The link's counters (``share.link.Link.stats``)."""
        return self.directory.link.stats

    def seal_plan(self) -> bytes | None:
        """The slab the plan just built moves bytes of, when plans name one."""
        return self.directory.seal_plan() if self.share.bind_plans else None

    def close(self) -> None:
        """Close the client's connections (the node process keeps running)."""
        self.directory.close()


def open_node_directory(
    tier: str,
    share: NodeShare,
    *,
    namespace: bytes,
    session: bytes,
    wait_s: float = START_WAIT_S,
) -> OpenedShare:
    """The scheduler half's directory of tier ``tier`` in its node process, booking
    under ``session`` (its workers' leases hold it open); ``namespace`` labels what it
    stores (``reset`` drops that namespace's chunks). The share's holds are kept
    until the directory is closed."""
    releases = take(share.holds)
    try:
        serving = serve_share(share, wait_s)
        directory = ShareDirectory(
            share.paths, geometry=serving.geometry, session=session, namespace=namespace,
            tier=tier, timeout_s=share.timeout_s, backing=share.backing,
            bind_plans=share.bind_plans,
        )  # fmt: skip
    except BaseException:
        release(releases)
        raise
    directory.on_close.append(lambda: release(releases))
    directory.wait_ready(wait_s)
    return OpenedShare(tier, share, directory, serving.started)


class NodeLease:
    """A worker's hold on a node share (see the module docstring): the share's
    holds and its ``users.lock`` (``kvoffload share remove`` refuses while it is
    held) from construction to :meth:`close`, and, once a plan names it, a lease on
    the engine's session (a later session, the scheduler half restarted, replaces
    it). Owned by the worker's store of the tier."""

    def __init__(self, share: NodeShare) -> None:
        self.share = share
        self._releases = take(share.holds)
        try:
            self.users = UsersHold(share.paths)
        except BaseException:
            release(self._releases)
            raise
        self.lease = SessionLease(self._open)

    def _open(self, session: bytes) -> Lease:
        return Lease(self.share.paths, session, users=self.users)

    def hold(self, session: bytes | None) -> None:
        """Lease ``session`` (from a plan's metadata) before any job of the plan runs."""
        self.lease.hold(session)

    def close(self) -> None:
        """Close the lease, then release the ``users.lock`` hold and the share's holds
        (after the worker's copies). Never raises past the lease's own close."""
        self.lease.close()
        self.users.release()
        release(self._releases)
        self._releases = []
