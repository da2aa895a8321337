"""Where one share's files live: all under one directory (``/dev/shm`` by default).

For a share named ``NAME`` in ``ROOT``::

    ROOT/kvoffload-NAME.sock          the node process's Unix socket
    ROOT/kvoffload-NAME.meta          the share's geometry and generation (JSON)
    ROOT/kvoffload-NAME.server.lock   held (flock, exclusive) by the live node process
    ROOT/kvoffload-NAME.gen-G.lock    held (flock, shared) by engines with transfers
                                      booked under generation G (see :mod:`.fence`)
    ROOT/kvoffload-NAME.index         the readable set, for lookups (see :mod:`.index`)
    ROOT/kvoffload-NAME.log           what node processes started by engines printed
    ROOT/kvoffload-NAME.slab.rR       tensor-parallel rank R's slots (see :mod:`.slab`)

Pure functions and one frozen value; nothing here touches the file system except
:func:`remove_share`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kvoffload.core.errors import ConfigError

DEFAULT_ROOT = Path("/dev/shm")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class SharePaths:
    """The files of share ``name`` under ``root``; a bad name is a :class:`ConfigError`."""

    name: str
    root: Path = DEFAULT_ROOT

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ConfigError(
                "host_share",
                f"{self.name!r} is not a share name: 1-64 letters, digits, '_', '.', '-'",
            )

    def _file(self, suffix: str) -> Path:
        return self.root / f"kvoffload-{self.name}.{suffix}"

    @property
    def socket(self) -> Path:
        return self._file("sock")

    @property
    def meta(self) -> Path:
        return self._file("meta")

    @property
    def server_lock(self) -> Path:
        return self._file("server.lock")

    def generation_lock(self, generation: int) -> Path:
        return self._file(f"gen-{generation}.lock")

    @property
    def log(self) -> Path:
        return self._file("log")

    @property
    def index(self) -> Path:
        return self._file("index")

    def slab(self, rank: int) -> Path:
        return self._file(f"slab.r{rank}")


def remove_share(paths: SharePaths) -> None:
    """Delete every file of the share (its node process must be stopped first):
    the memory of its slabs goes back to the system once no engine maps them."""
    for path in paths.root.glob(f"kvoffload-{paths.name}.*"):
        path.unlink(missing_ok=True)
