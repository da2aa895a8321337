"""Fencing node-process generations with file locks (``flock``, released by the
kernel when a process dies, SIGKILL included).

A node process that crashed may leave engines with transfers in flight into slots it
had booked. Its successor starts with an empty directory and would hand those slots
out again, so a late write could tear a new chunk (or a late read see one being
written). Hence:

- an engine's scheduler half holds a *shared* lock on ``gen-G.lock`` from the moment
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
import re
from pathlib import Path

from kvoffload.share.paths import SharePaths


def _try_lock(path: Path, mode: int) -> int | None:
    """An open descriptor of ``path`` locked with ``mode`` (non-blocking), or None."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
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
        self._fd = _try_lock(paths.generation_lock(generation), fcntl.LOCK_SH)

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
        self._pattern = re.compile(rf"^kvoffload-{re.escape(paths.name)}\.gen-(\d+)\.lock$")

    def older(self) -> list[Path]:
        return [
            path
            for path in self._paths.root.iterdir()
            if (m := self._pattern.match(path.name)) and int(m.group(1)) < self._generation
        ]

    def open(self) -> bool:
        """True once every older generation's lock could be taken (then removed)."""
        for path in self.older():
            fd = _try_lock(path, fcntl.LOCK_EX)
            if fd is None:
                return False
            path.unlink(missing_ok=True)
            os.close(fd)
        return True
