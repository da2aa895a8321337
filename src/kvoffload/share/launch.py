"""Starting a share's node process from an engine that cannot reach it.

Election: the live node process holds the share's server lock (exclusive flock). An
engine that finds no one listening tests the lock; if it is free, nobody serves the
share and the engine starts a node process (:func:`spawn_server`), detached in its own
session so that it outlives the engine. Two engines may both start one: the second
finds the lock held and exits at once. The child reports readiness by closing a pipe
(:class:`Spawned`), so its starter can wait for it without polling.
"""

from __future__ import annotations

import fcntl
import os
import select
import subprocess
import sys
from dataclasses import dataclass

from kvoffload.core.errors import KvOffloadError
from kvoffload.core.private_files import open_checked, open_or_create
from kvoffload.share.backing import Backing
from kvoffload.share.memory_backing import MemoryBacking
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.paths import SharePaths


def server_alive(paths: SharePaths) -> bool:
    """Whether a node process holds the share's server lock now (a lock file this
    share does not trust, or none: no)."""
    try:
        fd = open_checked(paths.server_lock, os.O_RDWR, paths.policy)
    except (OSError, KvOffloadError):
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # also drops the lock if it was taken
    return False


@dataclass
class Spawned:
    """A node process this engine started; ``ready_fd`` reads EOF once it listens
    (or died)."""

    process: subprocess.Popen[bytes]
    ready_fd: int

    def wait_ready(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` until the child listens or exits; True if it
        listens (or exited because another node process serves the share)."""
        readable, _, _ = select.select([self.ready_fd], [], [], timeout_s)
        if not readable:
            return False
        self.close()
        return True

    def close(self) -> None:
        if self.ready_fd >= 0:
            os.close(self.ready_fd)
            self.ready_fd = -1
        self.process.poll()  # reaps it if it already exited


def serve_arguments(
    paths: SharePaths, geometry: ShareGeometry | None, backing: Backing
) -> list[str]:
    """The arguments of the node process of this share (``python -m`` its backing's
    module, :mod:`.serve` for shared-memory slabs, with the backing's options)."""
    args = [paths.name, "--root", str(paths.root)]
    if paths.group is not None:
        args += ["--group", str(paths.group)]
    args += backing.arguments()
    if geometry is not None:
        args += [
            "--slots", str(geometry.num_slots), "--slot-bytes", str(geometry.slot_bytes),
            "--ranks", str(geometry.ranks), "--policy", geometry.policy,
            "--store-threshold", str(geometry.store_threshold),
            "--max-admission-counters", str(geometry.max_admission_counters),
        ]  # fmt: skip
    return args


def spawn_server(
    paths: SharePaths, geometry: ShareGeometry | None, backing: Backing | None = None
) -> Spawned | None:
    """Start a node process unless one holds the lock (None then), over ``backing``
    (shared-memory slabs when None). Makes the share's directories first
    (:class:`ConfigError` naming ``host_share_root`` when another user made them, or
    made its log)."""
    backing = MemoryBacking(paths.name) if backing is None else backing
    module = backing.module
    paths.ensure_dir()
    if server_alive(paths):
        return None
    log = open_or_create(paths.log, os.O_WRONLY | os.O_APPEND, paths.policy)
    read_fd, write_fd = os.pipe()
    try:
        process = subprocess.Popen(
            [sys.executable, "-m", module, *serve_arguments(paths, geometry, backing),
             "--ready-fd", str(write_fd)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
            pass_fds=(write_fd,),
        )  # fmt: skip
    except OSError:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
        os.close(log)
    return Spawned(process, read_fd)
