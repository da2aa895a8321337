"""The host slabs the check copies to: private, and node-shared as a share makes them.

:func:`host_slab` is the transfer worker's own :class:`~kvoffload.tiers.host.HostSlab`
(page-locked with ``pinned``). :func:`shared_slab` makes rank 0's slab file the way a
share's node process does (:func:`~kvoffload.share.slab_files.create_slab_files` in a
:class:`~kvoffload.share.paths.SharePaths` directory) under a private temporary root
(:func:`private_root`), and maps it as an engine's worker does
(:class:`~kvoffload.tiers.host_shared_slab.SharedSlab`; with ``pinned``, registered
with ``cudaHostRegister``). Nothing here touches a real share.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from kvoffload.share.meta import ShareGeometry
from kvoffload.share.paths import SharePaths
from kvoffload.share.slab_files import create_slab_files, free_bytes
from kvoffload.tiers.host import HostSlab
from kvoffload.tiers.host_shared_slab import SharedSlab

SHM = Path("/dev/shm")


@contextlib.contextmanager
def private_root(need_bytes: int) -> Iterator[Path]:
    """A new 0700 directory, removed (with everything in it) on exit: in ``/dev/shm``
    (memory, where shares live) when it has ``need_bytes`` free, else in the default
    temporary directory."""
    base: str | None = None
    if SHM.is_dir() and os.access(SHM, os.W_OK) and free_bytes(SHM) >= need_bytes:
        base = str(SHM)
    root = Path(tempfile.mkdtemp(prefix="kvo-check-", dir=base))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def host_slab(chunk_bytes: int, num_slots: int, *, pinned: bool) -> HostSlab:
    """A private slab of ``num_slots`` chunks (page-locked when ``pinned``)."""
    return HostSlab(chunk_bytes, chunk_bytes * num_slots, pin_memory=pinned)


def make_share(root: Path, name: str, chunk_bytes: int, num_slots: int) -> SharedSlabFiles:
    """Make share ``name``'s directory and rank 0's slab file under ``root``, as the
    node process does."""
    paths = SharePaths(name, root=root)
    paths.ensure_dir()
    geometry = ShareGeometry(num_slots=num_slots, slot_bytes=chunk_bytes)
    return SharedSlabFiles(paths, geometry.with_slab_id(create_slab_files(paths, geometry)))


class SharedSlabFiles:
    """A share's files as made by :func:`make_share`; :meth:`open` maps them, as many
    times as asked (each mapping is an engine's view of the same memory)."""

    def __init__(self, paths: SharePaths, geometry: ShareGeometry) -> None:
        self.paths = paths
        self.geometry = geometry

    def open(self, *, pinned: bool) -> SharedSlab:
        """Rank 0's slab, mapped; registered for DMA when ``pinned`` (CUDA)."""
        return SharedSlab(self.paths, self.geometry, 0, self.geometry.slot_bytes, pin_memory=pinned)

    def remove(self) -> None:
        """Delete the share's directory (mappings stay valid; the memory goes with
        the last one), so that many cases never fill a small ``/dev/shm``."""
        shutil.rmtree(self.paths.dir, ignore_errors=True)
