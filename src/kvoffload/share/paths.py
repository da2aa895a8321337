"""Where one share's files live: the one place that knows the layout (decision 0018).

For a share named ``NAME`` in ``ROOT`` (``host_share_root``, ``/dev/shm`` by default),
every file is in a directory of this user's own, ``ROOT/kvoffload-u<UID>/NAME/``
(both directories mode 0700; with ``host_share_group`` G, ``ROOT/kvoffload-g<G>/NAME/``,
mode 2770, group G)::

    sock          the node process's Unix socket
    meta          the share's geometry, generation and slab id (JSON)
    server.lock   held (flock, exclusive) by the live node process; holds its pid
    users.lock    held (flock, shared) by every process of every engine attached
    gen-G.lock    held (flock, shared) by engines with transfers booked under
                  generation G (see :mod:`.fence`)
    index         the readable set, for lookups (see :mod:`.index`)
    log           what node processes started by engines printed
    slab.rR       tensor-parallel rank R's slots (see :mod:`.slab`)
    .*.tmp        a file being made (:func:`~kvoffload.core.private_files.replace_atomically`)

Two shares never share a file: a name is one path component (no ``/``), so share
``a1`` and share ``a1.b`` are two directories. Pure functions and one frozen value;
nothing here touches the file system except :meth:`SharePaths.ensure_dir`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from kvoffload.core.config.own_options import default
from kvoffload.core.errors import ConfigError
from kvoffload.core.private_files import FilePolicy, check_root, make_private_dir

DEFAULT_ROOT = Path(default("host_share_root"))
"""Where shares live unless ``host_share_root`` names another directory."""
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
SOCKET_PATH_BYTES = 107
"""The longest Unix socket path (``sun_path`` is 108 bytes with its terminating NUL)."""
TEMPORARY_SOCKET = "sock.new"
"""The name the node process binds before renaming it to ``sock``."""
SLAB = re.compile(r"^slab\.r(\d+)$")
GENERATION_LOCK = re.compile(r"^gen-(\d+)\.lock$")
TEMPORARY = re.compile(r"^\..+\.\d+\.[0-9a-f]+\.tmp$")
FIXED_NAMES = ("sock", TEMPORARY_SOCKET, "meta", "server.lock", "users.lock", "index", "log")
"""Every name of a share's file but the numbered ones (:data:`SLAB`,
:data:`GENERATION_LOCK`) and temporaries (:data:`TEMPORARY`)."""


@dataclass(frozen=True)
class SharePaths:
    """The files of share ``name`` under ``root`` (see the module docstring), trusted
    to this user (``uid``, the effective one) or, with ``group``, to that group's
    members. A bad name, or a root too long for the socket's path, is a
    :class:`ConfigError`."""

    name: str
    root: Path = DEFAULT_ROOT
    group: int | None = None
    uid: int = field(default_factory=os.geteuid)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ConfigError(
                "host_share",
                f"{self.name!r} is not a share name: 1-64 letters, digits, '_', '.', '-'",
            )
        longest = len(os.fsencode(self.dir / TEMPORARY_SOCKET))
        if longest > SOCKET_PATH_BYTES:
            raise ConfigError(
                "host_share_root",
                f"share {self.name!r}: its socket path {self.dir / TEMPORARY_SOCKET} is "
                f"{longest} bytes, more than the {SOCKET_PATH_BYTES} a Unix socket's path "
                "may have: choose a shorter host_share_root (or share name)",
            )

    @property
    def policy(self) -> FilePolicy:
        """Who is trusted with these files (see :mod:`kvoffload.core.private_files`)."""
        return FilePolicy(self.name, self.group, self.uid)

    @property
    def user_dir(self) -> Path:
        """``ROOT/kvoffload-u<UID>`` (``kvoffload-g<GID>`` with a group)."""
        who = f"u{self.uid}" if self.group is None else f"g{self.group}"
        return self.root / f"kvoffload-{who}"

    @property
    def dir(self) -> Path:
        """The share's own directory: every file of the share, nothing else."""
        return self.user_dir / self.name

    def ensure_dir(self, *, create: bool = True) -> None:
        """Check the root and create (or check) the per-user directory and the share's
        (see :mod:`kvoffload.core.private_files`); a :class:`ConfigError` naming
        ``host_share_root`` when another user made one of them or could replace it.
        ``create`` False: only check them (``FileNotFoundError`` when one is
        missing)."""
        policy = self.policy
        check_root(self.root, policy)
        make_private_dir(self.user_dir, policy, create=create)
        make_private_dir(self.dir, policy, create=create)

    @property
    def socket(self) -> Path:
        return self.dir / "sock"

    @property
    def temporary_socket(self) -> Path:
        return self.dir / TEMPORARY_SOCKET

    @property
    def meta(self) -> Path:
        return self.dir / "meta"

    @property
    def server_lock(self) -> Path:
        return self.dir / "server.lock"

    @property
    def users_lock(self) -> Path:
        return self.dir / "users.lock"

    def generation_lock(self, generation: int) -> Path:
        return self.dir / f"gen-{generation}.lock"

    @property
    def log(self) -> Path:
        return self.dir / "log"

    @property
    def index(self) -> Path:
        return self.dir / "index"

    def slab(self, rank: int) -> Path:
        return self.dir / f"slab.r{rank}"


def known_name(name: str) -> bool:
    """Whether ``name`` is one of a share's files (see the module docstring)."""
    return (
        name in FIXED_NAMES
        or SLAB.match(name) is not None
        or GENERATION_LOCK.match(name) is not None
        or TEMPORARY.match(name) is not None
    )
