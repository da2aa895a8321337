"""A worker's host slots in a node share (``host_share``, decisions 0016 and 0018).

:class:`SharedHostSlab` is one worker's view of the share: its rank's slab (a
:class:`~kvoffload.tiers.host_shared_slab.SharedSlab`: the host slots the transfer
worker copies to and from), and its :class:`~kvoffload.tiers.node_shares.NodeLease`
(the share's ``users.lock`` for the worker's life, and the lease on its engine's
session from the first plan that names it, before any job of that plan runs). Before
any job of a plan runs it also checks that its slab is the one the plan names
(:meth:`SharedHostSlab.admit`).

Ownership: each worker owns its :class:`SharedHostSlab` and closes it after its
copies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from kvoffload.core.errors import KvOffloadError
from kvoffload.tiers.host_shared_slab import SharedSlab
from kvoffload.tiers.node_shares import NodeLease, NodeShare, serve_share


class SharedHostSlab(SharedSlab):
    """Rank ``rank``'s slots of the host share (see the module docstring); raises
    ``ConfigError`` when no node process serves the share or the engine's chunks of
    ``chunk_bytes`` do not fit it."""

    def __init__(self, share: NodeShare, *, chunk_bytes: int, rank: int) -> None:
        serving = serve_share(share)
        self.started = serving.started
        self.node = NodeLease(share)
        try:
            super().__init__(share.paths, serving.geometry, rank, chunk_bytes)
        except BaseException:
            self.node.close()
            raise
        self.remaps = 0  # times the slab was remapped to the share's new files

    def hold(self, session: bytes | None) -> None:
        """Hold a lease on ``session`` (from a plan's metadata) before running its
        jobs; a later session (the scheduler half restarted) replaces it."""
        self.node.hold(session)

    def admit(self, slab_id: bytes | None, busy: Callable[[], bool]) -> str | None:
        """Before any job of a plan naming ``slab_id`` runs: None when this worker's
        slab is that one, else why the plan's jobs that touch host slots must fail.

        When the share's rank file now carries ``slab_id`` (its files were made anew)
        and nothing of this worker is in flight on the old mapping (``busy()`` False:
        those copies belong to a node process that is gone, and are settled by the
        scheduler half, never made readable), the slab is remapped to it first, and
        the ``users.lock`` hold taken again in the new directory. Never raises."""
        slab = self
        if slab_id == slab.slab_id:
            return None
        if slab_id is None:
            return "host share: the plan names no slab (no node process answered)"
        if slab.file_slab_id() != slab_id:
            return (
                f"host share: the plan's slab {slab_id.hex()} is not the share's file "
                f"{slab.paths.slab(slab.rank)} (its node process was replaced)"
            )
        if busy():
            return "host share: copies on the share's old slab are still in flight"
        try:
            remapped = slab.remap(slab_id)
        except (OSError, KvOffloadError) as exc:  # (a CUDA registration refused, say)
            return f"host share: remapping the slab failed ({exc})"
        if not remapped:
            return f"host share: the slab {slab_id.hex()} could not be mapped"
        self.remaps += 1
        with contextlib.suppress(OSError, KvOffloadError):
            self.node.users.refresh()
        return None

    def describe(self) -> str:
        """This worker's part of its start-up line."""
        who = "started its node process" if self.started else "found it running"
        return f"slab of host share {self.paths.name!r} ({self.paths.slab(self.rank)}; {who})"

    def close(self) -> None:
        """Close the lease, unmap this worker's view of the slab and release the
        ``users.lock`` hold (never raises)."""
        self.node.lease.close()
        super().close()
        self.node.close()
