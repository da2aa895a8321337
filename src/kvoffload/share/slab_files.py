"""The share's rank slab files: their layout, and their creation by the node process
(which imports no torch: this module does not either).

File ``kvoffload-NAME.slab.rR`` (in ``/dev/shm``: memory, not disk)::

    offset 0      4 KiB header: magic b"KVSH", u16 version, u16 rank, u16 ranks,
                  u16 reserved, u64 slot bytes, u64 slots
    offset 4096   slot 0, slot 1, ... each ``slot_bytes`` bytes, back to back
"""

from __future__ import annotations

import os
import struct

from kvoffload.share.geometry import ShareGeometry
from kvoffload.share.paths import SharePaths

_MAGIC = b"KVSH"
_VERSION = 1
_HEADER = struct.Struct("<4sHHHHQQ")
HEADER_BYTES = 4096


def header(geometry: ShareGeometry, rank: int) -> bytes:
    fields = _HEADER.pack(
        _MAGIC, _VERSION, rank, geometry.ranks, 0, geometry.slot_bytes, geometry.num_slots
    )
    return fields + bytes(HEADER_BYTES - len(fields))


def file_bytes(geometry: ShareGeometry) -> int:
    return HEADER_BYTES + geometry.num_slots * geometry.slot_bytes


def create_slab_files(paths: SharePaths, geometry: ShareGeometry) -> None:
    """Make sure every rank's file exists with this geometry (node process only).

    A file with the right header is kept as it is (its bytes are not trusted: the
    directory starts empty); one with another header is replaced (an engine still
    mapping the old one keeps that memory until it unmaps it)."""
    for rank in range(geometry.ranks):
        path = paths.slab(rank)
        wanted = header(geometry, rank)
        try:
            with open(path, "rb") as f:
                if f.read(HEADER_BYTES) == wanted and os.fstat(f.fileno()).st_size == file_bytes(
                    geometry
                ):
                    continue
        except FileNotFoundError:
            pass
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, file_bytes(geometry))
            os.pwrite(fd, wanted, 0)
        finally:
            os.close(fd)
        os.replace(temporary, path)
