"""A share whose slots are the disk tier's slab files: the disk tier shared by every
engine of a node.

A disk share is a share like the host one (the same node process, directory,
sessions, fencing and index; :mod:`kvoffload.share.server`) whose slots live in the disk tier's
slab files, ``ROOT/kvoffload-v1/<namespace hex>/slab.rR`` (:mod:`kvoffload.tiers.disk`,
format unchanged: ``kvoffload inspect disk`` and a later private engine read them),
instead of shared-memory slabs. There is one per (``disk_path``, namespace): its name
is derived from both (:meth:`DiskBacking.share_name`); its runtime files (socket,
meta, locks, index, log) live in its directory under the share root
(``/dev/shm/kvoffload-u<UID>/disk-HASH/`` by default, made and opened as
:mod:`kvoffload.core.private_files` says), so ``kvoffload share remove`` never touches the
slabs.

Its node process:

- holds the namespace directory's :class:`~kvoffload.tiers.disk_lock.DiskLock` for
  its whole life, recorded as this share's (a private engine and a disk share never
  use one namespace at once);
- prepares every rank's slab with the share's geometry (:meth:`DiskBacking.prepare`;
  ``slot_bytes`` is the per-rank chunk payload, ``num_slots`` the disk tier's slots):
  created, resized, preallocated, its superblock written, as a private engine does;
- once its generation fence is open, and before it books or answers any load,
  restores into its directory every complete chunk found in the slabs
  (:meth:`DiskBacking.recover`), since disk bytes carry their own headers and checksums (a host
  share's shared memory does not, so it starts empty).

Engines' workers open their rank's slab with ``DiskStore(..., attach=True)``.

:class:`DiskBacking` is this share's :class:`~kvoffload.share.backing.Backing`; the node process
is ``python -m kvoffload.tiers.disk_backing NAME --disk-root PATH --namespace HEX``
and the options of ``kvoffload share serve`` (``--slots``, ``--slot-bytes`` the
per-rank chunk payload, ``--ranks``, ``--policy``, ``--root``; NAME may be left out:
it is derived; ``--cpu-bytes`` would count payload bytes only, so give ``--slots``).
``kvoffload share stop NAME`` and ``remove NAME`` work for it by name; ``remove``
deletes its runtime files, never the slabs.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvoffload.core.errors import UsageError
from kvoffload.core.keys import ChunkKey
from kvoffload.share.backing import Recovered
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.paths import DEFAULT_ROOT, SharePaths
from kvoffload.share.slab_files import SLAB_ID_BYTES
from kvoffload.tiers.disk import DiskStore
from kvoffload.tiers.disk_index import recover_chunks
from kvoffload.tiers.disk_lock import DiskLock


@dataclass(frozen=True)
class DiskBacking:
    """The disk tier a share keeps its slots in: ``root`` is the ``disk_path``,
    ``namespace`` the namespace digest (16 bytes)."""

    root: Path
    namespace: bytes
    tier = "disk"
    config_key = "disk_path"
    module = "kvoffload.tiers.disk_backing"
    restores = True  # every slot carries its own header and checksum

    def share_name(self) -> str:
        """The share's name: ``disk-`` and 16 hex digits of the hash of the real path
        of ``root`` and the namespace (so two spellings of one directory agree)."""
        digest = hashlib.sha256(os.fsencode(os.path.realpath(self.root)) + b"\0" + self.namespace)
        return "disk-" + digest.hexdigest()[:16]

    def paths(self, share_root: Path = DEFAULT_ROOT, group: int | None = None) -> SharePaths:
        """The share's runtime files under ``share_root`` (the slabs stay on disk),
        trusted to this user or to ``group`` (``host_share_group``)."""
        return SharePaths(self.share_name(), share_root, group)

    def arguments(self) -> list[str]:
        """The node process's command-line options naming this backing."""
        return ["--disk-root", str(self.root), "--namespace", self.namespace.hex()]

    def hold(self, share: str) -> Callable[[], None]:
        """The namespace directory's :class:`DiskLock`, recorded as share ``share``'s
        (a private engine holding it: :class:`ConfigError` naming ``disk_path``)."""
        return DiskLock.acquire(self.root, self.namespace, share=share).release

    def prepare(self, paths: SharePaths, geometry: ShareGeometry) -> bytes:
        """Create (or resize) every rank's slab with the share's geometry: preallocated,
        superblock written; chunks already there are kept (a full disk is a
        :class:`~kvoffload.core.errors.ConfigError` naming ``disk_bytes``). The slab id
        is drawn when the share's meta file is made, and kept with it."""
        for rank in range(geometry.ranks):
            DiskStore(
                self.root, self.namespace, rank, geometry.slot_bytes, geometry.num_slots
            ).close()
        return geometry.slab_id or os.urandom(SLAB_ID_BYTES)

    def owned_files(self, paths: SharePaths, geometry: ShareGeometry) -> list[Path]:
        """None under the share's directory: the slabs are the disk tier's files."""
        return []

    def recover(self, geometry: ShareGeometry) -> tuple[list[tuple[ChunkKey, int]], Recovered]:
        """The complete chunks in the share's slabs, oldest first, and the counts."""
        entries, recovery = recover_chunks(
            self.root, self.namespace, geometry.ranks, geometry.num_slots, geometry.slot_bytes
        )
        return entries, Recovered(recovery.adopted, recovery.ignored)


class DiskBackingOptions:
    """``--disk-root PATH --namespace HEX`` on the node process's command line."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--disk-root", type=Path, required=True, help="the disk_path")
        parser.add_argument("--namespace", required=True, help="the namespace digest (hex)")

    def from_arguments(self, args: argparse.Namespace) -> DiskBacking:
        try:
            namespace = bytes.fromhex(args.namespace)
        except ValueError:
            raise UsageError(f"--namespace: not hex: {args.namespace!r}") from None
        return DiskBacking(args.disk_root, namespace)


if __name__ == "__main__":
    from kvoffload.share.serve import node_process_main

    sys.exit(node_process_main(sys.argv[1:], DiskBackingOptions()))
