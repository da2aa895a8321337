"""The share's slots: one shared-memory file per tensor-parallel rank, mapped by
every engine's worker of that rank.

File ``slab.rR`` of the share's directory (in ``/dev/shm``: memory, not disk), laid
out as :mod:`kvoffload.share.slab_files` says, opened as :mod:`kvoffload.core.private_files` says
(never a link, never a file another user made).

One file per rank, rather than rank-major regions of one file: a worker maps, prefaults
and registers for DMA only its own rank's memory (1/ranks of the share), and each
rank's file can be placed on its own NUMA node by whoever first touches it. Every
rank uses the same slot numbers (the scheduler half books a slot for all ranks).

:class:`SharedSlab` offers what the transfer worker uses of
:class:`~kvoffload.tiers.host.HostSlab` (``chunk_bytes``, ``num_slots``, ``pinned``,
``nbytes``, ``data``, ``view``, ``slot_tensor``, ``slot_bytes``), so it can stand in
for it. Page-locking: when CUDA is available the mapping is registered with
``cudaHostRegister`` (the driver pins the shared pages for this process; several
processes may register the same pages), and unregistered by :meth:`close`. That path
is not exercised by the tests (they run without CUDA).

Ownership: the node process creates (and sizes) the files (:mod:`kvoffload.share.slab_files`);
engines map them and never resize or delete them. Which slot may be read or written
when is decided by the share's directory (two-phase bookings); the slab does no
locking. The bytes of a slot are never trusted without the directory: a restarted
node process starts with an empty directory.

Identity (decision 0018): :attr:`SharedSlab.slab_id` is the id in the header of the
file this process maps. When the share's files were made anew (its directory was
deleted wholesale, and a new node process made new slab files under a new id), the
mapping still shows the old, deleted file: :meth:`SharedSlab.remap` replaces it, at
the same address (``MAP_FIXED``: every view of the slab stays valid), with the
share's file now, if that file carries the id asked for. The caller (the worker,
:class:`~kvoffload.tiers.host_shared.SharedHostSlab`) remaps only when no copy
of its own is in flight on the old mapping.
"""

from __future__ import annotations

import ctypes
import mmap
import os

import torch

from kvoffload.core.errors import ConfigError, KvOffloadError
from kvoffload.core.private_files import open_checked
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.paths import SharePaths
from kvoffload.share.slab_files import HEADER_BYTES, file_bytes, header, slab_id_of
from kvoffload.tiers.slot_rows import SlotRows


class SharedSlab(SlotRows):
    """Rank ``rank``'s slots of a share, mapped into this process (see module doc).

    ``chunk_bytes`` is this engine's chunk size for the rank; it must equal the
    share's slot size (else :class:`ConfigError`, before any memory is touched), and
    the file must have the share's geometry and size (else :class:`ConfigError`).
    ``prefault`` reads every page once so no copy pays first-touch faults.
    """

    def __init__(
        self,
        paths: SharePaths,
        geometry: ShareGeometry,
        rank: int,
        chunk_bytes: int,
        *,
        pin_memory: bool | None = None,
        prefault: bool = True,
    ) -> None:
        geometry.check_fits(chunk_bytes, rank)
        self.chunk_bytes = geometry.slot_bytes
        self.num_slots = geometry.num_slots
        self.rank = rank
        self.paths = paths
        self.geometry = geometry
        self._prefault = prefault
        fd = self._open(None)
        try:
            self.slab_id = slab_id_of(os.pread(fd, HEADER_BYTES, 0))
            self._map = mmap.mmap(fd, file_bytes(geometry), flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        self._attach(whole[HEADER_BYTES:], self.num_slots, self.chunk_bytes)
        self._touch()
        self.pinned = False
        if pin_memory if pin_memory is not None else torch.cuda.is_available():
            self._register()

    def _open(self, slab_id: bytes | None) -> int:
        """The share's rank file now, checked: its header is this geometry's (with
        ``slab_id``, or any id when None) and its size the geometry's, else
        :class:`ConfigError` (a shorter file would fault when touched)."""
        path = self.paths.slab(self.rank)
        fd = open_checked(path, os.O_RDWR, self.paths.policy)
        try:
            head = os.pread(fd, HEADER_BYTES, 0)
            wanted = slab_id_of(head) if slab_id is None else slab_id
            if head != header(self.geometry, self.rank, wanted):
                raise ConfigError("host_share", f"{path} has another geometry or slab id")
            if os.fstat(fd).st_size != file_bytes(self.geometry):
                raise ConfigError("host_share", f"{path} is not the share's size")
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _touch(self) -> None:
        if hasattr(mmap, "MADV_HUGEPAGE"):
            self._map.madvise(mmap.MADV_HUGEPAGE)
        if self._prefault:
            # Read each page (never write: another engine may be writing that byte).
            int(self._flat[:: mmap.PAGESIZE].sum())

    def file_slab_id(self) -> bytes:
        """The slab id of the share's rank file now (b"": none, or not trusted)."""
        try:
            fd = open_checked(self.paths.slab(self.rank), os.O_RDONLY, self.paths.policy)
        except (OSError, KvOffloadError):
            return b""
        try:
            return slab_id_of(os.pread(fd, HEADER_BYTES, 0))
        finally:
            os.close(fd)

    def remap(self, slab_id: bytes) -> bool:
        """Map the share's rank file now in place of the old mapping, at the same
        address, if it carries ``slab_id`` (and this geometry); whether it did.
        Nothing may copy to or from the slab meanwhile (the caller's duty); a pinned
        mapping is registered again (CUDA)."""
        try:
            fd = self._open(slab_id)
        except (OSError, KvOffloadError):
            return False
        pinned = self.pinned
        try:
            if pinned:
                self._unregister()
            base = self._flat.data_ptr() - HEADER_BYTES
            length = file_bytes(self.geometry)
            got = _map_fixed(base, length, fd)
            if got != base:
                raise OSError(ctypes.get_errno(), "mmap MAP_FIXED failed")
        finally:
            os.close(fd)
        self.slab_id = slab_id
        self._touch()
        if pinned:
            self._register()
        return True

    def _register(self) -> None:
        """Page-lock the mapping for DMA (CUDA only; untested without a GPU)."""
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        error = cudart.cudaHostRegister(self._flat.data_ptr(), self.nbytes, 0)
        if int(error) != 0:
            raise ConfigError("host_share", f"cudaHostRegister failed ({error})")
        self.pinned = True

    def _unregister(self) -> None:
        torch.cuda.cudart().cudaHostUnregister(  # type: ignore[no-untyped-call]
            self._flat.data_ptr()
        )
        self.pinned = False

    def close(self) -> None:
        """Unregister (CUDA) and drop this process's views; the mapping itself goes
        when the last view does. The file and the others' mappings are untouched."""
        if self.pinned:
            self._unregister()


_MAP_FIXED = 0x10  # Linux


def _map_fixed(addr: int, length: int, fd: int) -> int:
    """``mmap(addr, length, read|write, MAP_SHARED|MAP_FIXED, fd, 0)``: the file mapped
    in place of what was at ``addr`` (Python's ``mmap`` cannot map at an address);
    the address mapped, or -1."""
    libc = ctypes.CDLL(None, use_errno=True)
    call = libc.mmap
    call.restype = ctypes.c_void_p
    call.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_long,
    ]  # fmt: skip
    prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | _MAP_FIXED
    result = call(addr, length, prot, flags, fd, 0)
    return -1 if result is None else int(result)
