"""Fencing node-process generations with file locks (``flock``, released by the
kernel when a process dies, SIGKILL included).

A node process that crashed may leave engines with transfers in flight into slots it
had booked. Its successor starts with an empty directory and would hand those slots
out again, so a late write could tear a new chunk (or a late read see one being
written). Hence:

- an engine's scheduler half holds a *shared* lock on ``gen-G.lock`` (in the share's
  directory, :mod:`.paths`) from the moment
  it is connected to generation G (before it books anything) until it has lost that
  connection and every transfer it booked there has completed
  (:class:`GenerationHold`);
- a node process of generation G' books no slot until it has taken an *exclusive*
  lock on every older generation's lock file (:class:`GenerationFence`), i.e. until
  no engine has a transfer of an older generation in flight. Then it deletes them.

An engine's workers take no lock: they move only chunks their scheduler half booked,
and it holds the lock until they have reported them.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from kvoffload.core.errors import ConfigError
from kvoffload.core.private_files import FilePolicy, open_or_create
from kvoffload.share.paths import GENERATION_LOCK, SharePaths


def _try_lock(path: Path, mode: int, policy: FilePolicy) -> int | None:
    """An open descriptor of ``path`` locked with ``mode`` (non-blocking), or None
    (also when the file cannot be opened, or is not one this share trusts)."""
    try:
        fd = open_or_create(path, os.O_RDWR, policy)
    except (OSError, ConfigError):
        return None
    try:
        fcntl.flock(fd, mode | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


class GenerationHold:
    """An engine's shared lock on one generation (see the module docstring)."""

    def __init__(self, paths: SharePaths, generation: int) -> None:
        self.generation = generation
        self._fd = _try_lock(paths.generation_lock(generation), fcntl.LOCK_SH, paths.policy)

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor drops the flock
            self._fd = None


class GenerationFence:
    """A node process's check that no older generation has transfers in flight."""

    def __init__(self, paths: SharePaths, generation: int) -> None:
        self._paths = paths
        self._generation = generation

    def older(self) -> list[Path]:
        """The lock files of older generations in the share's directory."""
        return [
            self._paths.dir / name
            for name in os.listdir(self._paths.dir)
            if (m := GENERATION_LOCK.match(name)) and int(m.group(1)) < self._generation
        ]

    def open(self) -> bool:
        """True once every older generation's lock could be taken (then removed)."""
        for path in self.older():
            fd = _try_lock(path, fcntl.LOCK_EX, self._paths.policy)
            if fd is None:
                return False
            path.unlink(missing_ok=True)
            os.close(fd)
        return True
