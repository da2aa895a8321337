"""Starting a share's node process (:func:`open_server`), in this order:

1. make (or check) the share's directories and take its server lock (flock,
   exclusive, non-blocking): at most one node process per share; a second one finds
   it held and exits (:class:`AlreadyServing`);
2. read the geometry from the meta file, or, for a new share, take the one given
   (the first engine's, or ``kvoffload share serve``'s arguments); bump the
   generation;
3. create or check the slots (the backing's: for shared-memory slabs
   :func:`~.slab_files.create_slab_files`: kept with their slab id, or made anew,
   their space reserved, under a new one), write the meta file (geometry,
   generation, slab id), and clear the index
   (:mod:`.index`), stamped with the new generation; a share larger than its root's
   free space is a :class:`ConfigError` naming ``host_share_root``;
4. listen on the socket: bound beside it, made 0600 (0660 with a group), then
   renamed over it, so a client never connects to a half-set-up socket; its pid goes
   into the server lock file.

Its backing (:mod:`.backing`: shared-memory slabs by default,
:class:`~.memory_backing.MemoryBacking`; e.g. the disk tier's slabs,
:class:`~kvoffload.tiers.disk_backing.DiskBacking`) takes its files alone after step 1
(:meth:`~.backing.Backing.hold`: e.g. a private engine holding the disk namespace is
a :class:`ConfigError` naming ``disk_path``, and the node process exits), and makes
or checks its slots in step 3 (:meth:`~.backing.Backing.prepare`, which says the slab
id). Then it serves (:class:`~.server.ShareServer`).
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
from collections.abc import Callable

from kvoffload.core.directory import Directory
from kvoffload.core.errors import ConfigError, KvOffloadError
from kvoffload.core.private_files import open_or_create
from kvoffload.share.backing import Backing
from kvoffload.share.index import IndexWriter
from kvoffload.share.memory_backing import MemoryBacking
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.paths import SharePaths
from kvoffload.share.server import ShareServer


class AlreadyServing(KvOffloadError):
    """Another node process holds this share's server lock."""


def open_server(
    paths: SharePaths, geometry: ShareGeometry | None, backing: Backing | None = None
) -> ShareServer:
    """Start-up steps 1-4 of the module docstring; :class:`AlreadyServing` if another
    node process runs, :class:`ConfigError` for a new share without a geometry (or a
    backing whose files someone else holds, or a share that does not fit its root's
    free space, or files another user made). ``backing``: shared-memory slabs when
    None."""
    return _open(paths, geometry, MemoryBacking(paths.name) if backing is None else backing)


def _open(paths: SharePaths, geometry: ShareGeometry | None, backing: Backing) -> ShareServer:
    paths.ensure_dir()
    lock_fd = open_or_create(paths.server_lock, os.O_RDWR, paths.policy)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(lock_fd)
        raise AlreadyServing(f"share {paths.name!r} already has a node process") from None
    release_backing: Callable[[], None] | None = None
    try:
        release_backing = backing.hold(paths.name)
        recorded = ShareGeometry.read(paths)
        chosen = recorded if recorded is not None else geometry
        if chosen is None:
            raise ConfigError(
                backing.config_key, f"share {paths.name!r} does not exist: give its size"
            )
        chosen = chosen.next_generation()
        directory = Directory(  # a bad policy or size fails here, before any file changes
            chosen.num_slots,
            tier=backing.tier,
            policy=chosen.policy,
            store_threshold=chosen.store_threshold,
            max_admission_counters=chosen.max_admission_counters,
        )
        chosen = chosen.with_slab_id(backing.prepare(paths, chosen))
        chosen.write(paths)
        index = IndexWriter(paths, chosen.num_slots, chosen.generation)
        listener = _listen(paths)
    except BaseException:
        if release_backing is not None:
            release_backing()
        os.close(lock_fd)
        raise
    os.ftruncate(lock_fd, 0)
    os.pwrite(lock_fd, struct.pack("<I", os.getpid()), 0)
    return ShareServer(
        paths,
        chosen,
        directory,
        lock_fd,
        listener,
        index=index,
        backing=backing,
        release_backing=release_backing,
    )


def _listen(paths: SharePaths) -> socket.socket:
    """The listening socket, bound under a temporary name (only the holder of the
    server lock binds there), given the policy's mode (whatever the umask), then
    renamed over the share's socket."""
    temporary = paths.temporary_socket
    temporary.unlink(missing_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(temporary))
        if paths.group is not None:
            os.chown(temporary, -1, paths.group)
        os.chmod(temporary, paths.policy.file_mode)  # in our own directory: no link
        listener.listen(128)
        os.replace(temporary, paths.socket)
    except BaseException:
        listener.close()
        raise
    return listener
