"""Slab files of the disk tier, opened read-only for inspection.

A slab file's name is ``slab.r<rank>`` (:func:`parse_slab_name`); :func:`open_slab`
opens one ``O_RDONLY | O_NOFOLLOW``, reads its superblock and checks it names the
expected namespace and rank (else :class:`NotASlab`, with a reason). The caller owns
the returned :class:`SlabFile`'s descriptor and closes it.
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass, field

from kvoffload.inspection.model import MAX_RANK, BadSlab
from kvoffload.tiers.slab_format import SUPERBLOCK_BYTES, Superblock, SuperblockError

SLAB_PREFIX = "slab.r"
"""A slab file's name is this and its rank (``kvoffload.tiers.disk.slab_path``)."""

_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)


def parse_slab_name(name: str) -> int | None:
    """The rank of a slab file's name (``slab.r<rank>``, exactly as the disk tier
    names it); None for any other name."""
    if not name.startswith(SLAB_PREFIX):
        return None
    rank = name[len(SLAB_PREFIX) :]
    if not (rank.isascii() and rank.isdigit()) or str(int(rank)) != rank:
        return None
    return int(rank) if int(rank) <= MAX_RANK else None


@dataclass
class SlabFile:
    """One open slab file whose superblock names its namespace and rank."""

    name: str  # relative to the tier root
    rank: int
    fd: int
    block: Superblock
    size: int  # of the file, in bytes
    stride: int = field(init=False)  # slot bytes
    present: int = field(init=False)  # slots that start before the end of the file

    def __post_init__(self) -> None:
        self.stride = self.block.slot_bytes
        beyond = max(0, self.size - SUPERBLOCK_BYTES)
        self.present = min(self.block.num_slots, -(-beyond // self.stride))

    @property
    def expected_size(self) -> int:
        return SUPERBLOCK_BYTES + self.block.num_slots * self.stride

    def short(self) -> BadSlab | None:
        if self.size >= self.expected_size:
            return None
        whole = max(0, self.size - SUPERBLOCK_BYTES) // self.stride
        last = self.block.num_slots - 1
        cut = f"slot {whole}" if whole == last else f"slots {whole}..{last}"
        detail = f"short: {self.size} of {self.expected_size} bytes, {cut} cut off"
        return BadSlab(self.name, self.rank, "short", detail)


class NotASlab(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


def open_slab(path: str, name: str, digest: bytes, rank: int) -> SlabFile:
    """Open a slab file read-only and read its superblock. :class:`NotASlab` when it
    is not a slab of this namespace and rank; ``FileNotFoundError`` when it is gone."""
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise NotASlab("unreadable", f"unreadable: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotASlab("unreadable", "not a regular file")
        try:
            block = Superblock.decode(os.pread(fd, SUPERBLOCK_BYTES, 0))
        except SuperblockError as exc:
            raise NotASlab("superblock", f"bad superblock: {exc}") from None
        except OSError as exc:
            raise NotASlab("unreadable", f"unreadable: {exc.strerror or exc}") from None
        if (block.namespace_digest, block.rank) != (digest, rank):
            raise NotASlab(
                "foreign",
                f"the superblock names namespace {block.namespace_digest.hex()} "
                f"rank {block.rank}, not this file's",
            )
        with contextlib.suppress(AttributeError, OSError):  # payloads are read only on demand
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return SlabFile(name, rank, fd, block, st.st_size)
    except BaseException:
        os.close(fd)
        raise
