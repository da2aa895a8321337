"""The share's rank slab files: their layout, and their creation by the node process
(which imports no torch: this module does not either).

File ``slab.rR`` of the share's directory (in ``/dev/shm``: memory, not disk)::

    offset 0      4 KiB header: magic b"KVSH", u16 version, u16 rank, u16 ranks,
                  u16 reserved, u64 slot bytes, u64 slots, 16 bytes slab id
    offset 4096   slot 0, slot 1, ... each ``slot_bytes`` bytes, back to back

The slab id (:attr:`~.meta.ShareGeometry.slab_id`) is one random value for every
rank's file of one incarnation of the share: a worker checks that the file it maps
is the one its engine's node process serves (:mod:`.slab`).

Space is reserved when a file is made (``posix_fallocate``): a share larger than its
file system's free space is refused at start (:class:`ConfigError` naming
``host_share_root``, the bytes asked and free), never a SIGBUS when a page is first
touched.
"""

from __future__ import annotations

import functools
import os
import struct
from pathlib import Path

from kvoffload.core.errors import ConfigError
from kvoffload.core.private_files import open_checked, replace_atomically
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.paths import SharePaths

_MAGIC = b"KVSH"
_VERSION = 2
_HEADER = struct.Struct("<4sHHHHQQ16s")
HEADER_BYTES = 4096
SLAB_ID_BYTES = 16


def header(geometry: ShareGeometry, rank: int, slab_id: bytes | None = None) -> bytes:
    """Rank ``rank``'s header (with ``slab_id``, else the geometry's)."""
    fields = _HEADER.pack(
        _MAGIC, _VERSION, rank, geometry.ranks, 0, geometry.slot_bytes, geometry.num_slots,
        geometry.slab_id if slab_id is None else slab_id,
    )  # fmt: skip
    return fields + bytes(HEADER_BYTES - len(fields))


def slab_id_of(head: bytes) -> bytes:
    """The slab id in a header read from a slab file (b"" when it is not one)."""
    if len(head) < _HEADER.size or head[:4] != _MAGIC:
        return b""
    return bytes(_HEADER.unpack_from(head)[-1])


def file_bytes(geometry: ShareGeometry) -> int:
    return HEADER_BYTES + geometry.num_slots * geometry.slot_bytes


def create_slab_files(paths: SharePaths, geometry: ShareGeometry) -> bytes:
    """Make sure every rank's file exists with this geometry (node process only), and
    return the slab id they carry.

    When every rank's file has the header ``geometry`` (its recorded slab id
    included) describes, the files are kept as they are (their bytes are not
    trusted: the directory starts empty) and so is their id. Otherwise every rank's
    file is made anew, space reserved, under a new random id (an engine still
    mapping an old one keeps that memory until it unmaps it, and is told by the id
    that it is not this share's any more). Not enough space: :class:`ConfigError`
    naming ``host_share_root``, nothing replaced."""
    if geometry.slab_id and all(_kept(paths, geometry, r) for r in range(geometry.ranks)):
        return geometry.slab_id
    slab_id = os.urandom(SLAB_ID_BYTES)
    reserve(paths, geometry.ranks * file_bytes(geometry), "its slabs")
    for rank in range(geometry.ranks):
        head = header(geometry, rank, slab_id)
        fill = functools.partial(_fill, paths, geometry=geometry, head=head)
        replace_atomically(paths.slab(rank), paths.policy, fill)
    return slab_id


def _kept(paths: SharePaths, geometry: ShareGeometry, rank: int) -> bool:
    try:
        fd = open_checked(paths.slab(rank), os.O_RDONLY, paths.policy)
    except (OSError, ConfigError):
        return False  # absent, or not trusted: made anew (a rename replaces it)
    try:
        size = os.fstat(fd).st_size
        return size == file_bytes(geometry) and os.pread(fd, HEADER_BYTES, 0) == header(
            geometry, rank
        )
    finally:
        os.close(fd)


def _fill(paths: SharePaths, fd: int, *, geometry: ShareGeometry, head: bytes) -> None:
    allocate(paths, fd, file_bytes(geometry))
    os.pwrite(fd, head, 0)


def free_bytes(root: Path) -> int:
    """Bytes an unprivileged writer may still allocate in ``root``'s file system."""
    st = os.statvfs(root)
    return st.f_bavail * st.f_frsize


def reserve(paths: SharePaths, nbytes: int, what: str) -> None:
    """Refuse (:class:`ConfigError` naming ``host_share_root``) a share whose
    ``nbytes`` of ``what`` exceed its root's free space."""
    free = free_bytes(paths.dir)
    if nbytes > free:
        raise no_space(paths, nbytes, free, what)


def allocate(paths: SharePaths, fd: int, nbytes: int) -> None:
    """Size the open file ``fd`` to ``nbytes`` with its space reserved
    (``posix_fallocate``); no space: :class:`ConfigError` naming ``host_share_root``."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        raise no_space(paths, nbytes, free_bytes(paths.dir), f"a file ({exc.strerror})") from None


def no_space(paths: SharePaths, asked: int, free: int, what: str) -> ConfigError:
    return ConfigError(
        "host_share_root",
        f"share {paths.name!r}: {paths.root} has {free} bytes free, {asked} bytes asked "
        f"for {what}: give the share less memory (cpu_bytes), free space there, or "
        "choose another host_share_root",
    )
