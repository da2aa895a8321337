"""Engines attached to a share: every process of an engine that uses the share (its
scheduler half's directory client, each worker's slab mapping and leases) holds a
*shared* ``flock`` on the share's ``users.lock`` for its life (:class:`UsersHold`);
``kvoffload share remove`` takes it *exclusive*, without waiting, and refuses while
anyone holds it (:func:`engines_attached`). The kernel drops a dead process's lock,
so a killed engine never blocks a removal.

A hold is taken on the file at the path now, checked after locking (a ``remove``
that deleted it meanwhile leaves a lock on a deleted file: taken again), and
:meth:`UsersHold.refresh` takes it again when the share's directory was replaced
(deleted wholesale, then made anew by a node process): every connection an engine
opens to the share (its link's, its leases') refreshes the hold first, so an engine
connected to a node process always holds that node process's ``users.lock``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading

from kvoffload.core.private_files import open_or_create, same_file
from kvoffload.share.paths import SharePaths


class UsersHold:
    """One process's shared hold on a share's ``users.lock`` (see the module
    docstring). Opening creates the share's directories if missing (a
    :class:`ConfigError` when another user made them); owned by whoever opened it, shared with the
    threads of its connections (every method takes its guard); :meth:`release` is
    idempotent and never raises."""

    def __init__(self, paths: SharePaths) -> None:
        self._paths = paths
        self._guard = threading.Lock()
        self._fd = -1
        paths.ensure_dir()
        self.refresh()

    def refresh(self) -> None:
        """Hold the ``users.lock`` at the share's path now (a no-op, two system calls,
        when it is the one held); the hold on a file since deleted is dropped. The
        share's directories are checked, not made (``FileNotFoundError`` while they
        are missing: whoever starts the next node process makes them)."""
        with self._guard:
            path = self._paths.users_lock
            if self._fd >= 0 and same_file(path, os.fstat(self._fd)):
                return
            self._paths.ensure_dir(create=False)
            while True:
                fd = open_or_create(path, os.O_RDWR, self._paths.policy)
                fcntl.flock(fd, fcntl.LOCK_SH)  # a remove holds it exclusive only briefly
                if same_file(path, os.fstat(fd)):
                    break
                os.close(fd)  # removed while we waited: take the new one
            self._close()
            self._fd = fd

    def release(self) -> None:
        with self._guard:
            self._close()

    def _close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
