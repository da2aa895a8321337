"""The default backing: a share's slots in shared-memory slab files of its own.

One file per tensor-parallel rank, ``slab.rR`` in the share's directory (in
``/dev/shm`` by default: memory, not disk), laid out and made as :mod:`.slab_files`
says. Their bytes are never trusted by a new node process (a crashed writer may have
left any slot half-written and memory carries no checksum), so the node process
starts with an empty directory (:attr:`MemoryBacking.restores` is False). The files
are the node process's own: removed or replaced, it stops serving.

Its node process is ``python -m kvoffload.share.serve NAME`` with the options of
``kvoffload share serve``. Engines' workers map their rank's file
(:class:`~kvoffload.tiers.host_shared_slab.SharedSlab`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvoffload.core.errors import UsageError
from kvoffload.core.keys import ChunkKey
from kvoffload.share.backing import Recovered
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.paths import DEFAULT_ROOT, SharePaths
from kvoffload.share.slab_files import create_slab_files


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class MemoryBacking:
    """Shared-memory slabs of the share named ``name`` (see the module docstring)."""

    name: str
    tier = "host"
    config_key = "host_share"
    namespace = b""
    module = "kvoffload.share.serve"
    restores = False

    def share_name(self) -> str:
        return self.name

    def paths(self, share_root: Path = DEFAULT_ROOT, group: int | None = None) -> SharePaths:
        return SharePaths(self.name, share_root, group)

    def arguments(self) -> list[str]:
        """None: the share's name and root say where its slabs are."""
        return []

    def hold(self, share: str) -> Callable[[], None]:
        """Nothing to take: the server lock makes the node process the files' only
        writer of their shape."""
        return _nothing

    def prepare(self, paths: SharePaths, geometry: ShareGeometry) -> bytes:
        """Every rank's slab with ``geometry`` (kept when they have it, else made anew
        under a new slab id; :func:`~.slab_files.create_slab_files`)."""
        return create_slab_files(paths, geometry)

    def owned_files(self, paths: SharePaths, geometry: ShareGeometry) -> list[Path]:
        return [paths.slab(rank) for rank in range(geometry.ranks)]

    def recover(self, geometry: ShareGeometry) -> tuple[list[tuple[ChunkKey, int]], Recovered]:
        """Nothing: shared memory's bytes are not trusted by a new node process."""
        return [], Recovered(0, 0)


class MemoryBackingOptions:
    """A host share's node process takes no options of its own beyond its name."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        return None

    def from_arguments(self, args: argparse.Namespace) -> MemoryBacking:
        if args.name is None:
            raise UsageError("name the share")
        return MemoryBacking(str(args.name))
