"""Opening a share from an engine's ``kv_connector_extra_config``.

Keys read (``host_share`` switches the share on; the others keep their meaning):

- ``host_share``: the share's name (letters, digits, ``_.-``);
- ``cpu_bytes``: the share's size, all ranks together, when this engine creates it;
- ``eviction``, ``store_threshold``: its policy and admission, when this engine
  creates it (a share keeps those of its creator);
- ``host_share_timeout_ms`` (default 5): the deadline of one directory call;
- ``host_share_root`` (default ``/dev/shm``): where its files live (in a directory
  of this user's own, decision 0018);
- ``host_share_group`` (default unset): a group whose members are trusted with the
  share's files like their owner.

The scheduler half calls :func:`open_share_directory`, each worker
:func:`open_share_slab` at start-up; whichever runs first starts the node process;
both wait for it (start-up only, up to ``wait_s``) and check that the engine's chunks
fit the share (:class:`ConfigError` otherwise). A node process that cannot serve
(e.g. the share does not fit its root's free space) or does not answer is a
:class:`ConfigError` saying what it logged, its pid and what to do
(:class:`NotStarted`).

Sessions: the scheduler half's directory draws a random session at each start (its
``session``). Each worker opens a lease on it (:func:`open_share_lease`) when it
first learns it, from the scheduler half's per-step metadata, before it runs any job
of that plan: so the engine's bookings stay held while any of its processes may still
copy, and a restarted engine never inherits (or releases) the bookings of its earlier
life, whose workers may linger. (An id derived from the configuration would not do:
data-parallel replicas share one configuration, and a restart keeps it.)
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvoffload.core.errors import ConfigError, KvOffloadError
from kvoffload.core.private_files import read_checked, resolve_group
from kvoffload.share.backing import Backing
from kvoffload.share.client import ShareDirectory
from kvoffload.share.connection import connect
from kvoffload.share.launch import Spawned, server_alive, spawn_server
from kvoffload.share.lease import Lease
from kvoffload.share.lifecycle import recorded_pid
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.paths import DEFAULT_ROOT, SharePaths
from kvoffload.share.protocol import Role
from kvoffload.share.slab import SharedSlab
from kvoffload.share.users import UsersHold


@dataclass(frozen=True)
class ShareSettings:
    paths: SharePaths
    cpu_bytes: int
    policy: str = "lru"
    store_threshold: int = 1
    timeout_s: float = 0.005

    @classmethod
    def from_config(cls, extra: Mapping[str, Any]) -> ShareSettings | None:
        """The settings in ``extra``, or None when it names no share; a bad value is a
        :class:`ConfigError` naming its key."""
        name = extra.get("host_share")
        if name is None:
            return None
        cpu_bytes = extra.get("cpu_bytes")
        if isinstance(cpu_bytes, bool) or not isinstance(cpu_bytes, int) or cpu_bytes < 1:
            raise ConfigError("cpu_bytes", f"the share's size: an integer >= 1, got {cpu_bytes!r}")
        timeout_ms = extra.get("host_share_timeout_ms", 5)
        if (
            isinstance(timeout_ms, bool)
            or not isinstance(timeout_ms, int | float)
            or not math.isfinite(timeout_ms)
            or timeout_ms <= 0
        ):
            raise ConfigError("host_share_timeout_ms", f"a number > 0, got {timeout_ms!r}")
        root = Path(str(extra.get("host_share_root", DEFAULT_ROOT)))
        group = resolve_group(extra.get("host_share_group"))
        return cls(
            SharePaths(str(name), root, group),
            cpu_bytes,
            str(extra.get("eviction", "lru")),
            int(extra.get("store_threshold", 1)),
            timeout_ms / 1000,
        )

    def geometry(self, chunk_bytes: int, ranks: int) -> ShareGeometry:
        """The geometry this engine would create the share with."""
        return ShareGeometry.for_budget(
            self.cpu_bytes, chunk_bytes, ranks,
            policy=self.policy, store_threshold=self.store_threshold,
        )  # fmt: skip


def ensure_share(settings: ShareSettings, geometry: ShareGeometry, wait_s: float) -> ShareGeometry:
    """Start the share's node process unless one serves it, wait until one does, and
    return the share's recorded geometry (start-up only: this may wait ``wait_s``).
    No node process that answers: a :class:`ConfigError` (:class:`NotStarted`)."""
    recorded = start_and_wait(settings.paths, geometry, wait_s)
    if isinstance(recorded, NotStarted):
        raise recorded.error("host_share", f"share {settings.paths.name!r}")
    return recorded


@dataclass(frozen=True)
class NotStarted:
    """No node process answered: ``pid`` is the one that runs but does not answer
    (None: none runs), ``logged`` the last line of the share's log."""

    paths: SharePaths
    pid: int | None
    logged: str

    def error(self, key: str, what: str) -> ConfigError:
        """The refusal, naming ``key`` (a node process that said which option it
        cannot serve with names that one, e.g. ``host_share_root`` when the share
        does not fit): ``what`` (the share), the pid, what it logged, what to do."""
        said = _REFUSAL.search(self.logged)
        if self.pid is None and said is not None:
            return ConfigError(said.group(1), said.group(2))
        name = self.paths.name
        if self.pid is not None:
            return ConfigError(
                key,
                f"{what}: its node process (pid {self.pid}) does not answer on "
                f"{self.paths.socket} (it last logged: {self.logged}): stop it with "
                f"`kvoffload share stop {name}`, or kill {self.pid} if that does not work",
            )
        return ConfigError(key, f"{what} did not start: {self.logged}")


_REFUSAL = re.compile(r"kvoffload config '([a-z_]+)': (.*)$")


def start_and_wait(
    paths: SharePaths,
    geometry: ShareGeometry,
    wait_s: float,
    backing: Backing | None = None,
) -> ShareGeometry | NotStarted:
    """:func:`ensure_share`'s work for any share (a backed share's with its
    ``backing``): the recorded geometry, or what is known of the node process that
    did not come up. Its directories made first (:class:`ConfigError` naming
    ``host_share_root`` when another user made them)."""
    deadline = time.monotonic() + wait_s
    started = False
    spawned: Spawned | None = None
    while True:
        opened = connect(paths, bytes(16), Role.LEASE, b"", 1.0)
        if opened is not None:
            opened[0].close()
            recorded = ShareGeometry.read(paths)
            if recorded is not None:
                return recorded
        if started or time.monotonic() >= deadline:
            return _not_started(paths, spawned, started)
        spawned = spawn_server(paths, geometry, backing)
        if spawned is not None:
            started = spawned.wait_ready(max(0.0, deadline - time.monotonic()))
            spawned.close()
        else:
            time.sleep(0.02)  # another process is starting it: look again shortly


def _not_started(paths: SharePaths, spawned: Spawned | None, ready: bool) -> NotStarted:
    """What is known of a node process that does not answer: the pid of the one that
    runs without answering (this engine's, which never said it was ready, or the
    server lock's holder), and the log's last line."""
    pid: int | None = None
    if spawned is not None and not ready and spawned.process.poll() is None:
        pid = spawned.process.pid
    elif spawned is None and server_alive(paths):
        pid = recorded_pid(paths)
    return NotStarted(paths, pid, last_line(paths))


def last_line(paths: SharePaths) -> str:
    """The last line of the share's log (what a node process last said)."""
    try:
        text = read_checked(paths.log, paths.policy, 1 << 16).decode(errors="replace")
    except (OSError, KvOffloadError):
        return "no log"
    lines = text.strip().splitlines()
    return lines[-1] if lines else "nothing logged"


def open_share_directory(
    settings: ShareSettings,
    *,
    chunk_bytes: int,
    ranks: int,
    namespace: bytes = b"",
    tier: str = "host",
    wait_s: float = 30.0,
    bind_plans: bool = False,
) -> ShareDirectory:
    """The scheduler half's directory of the share (see the module docstring);
    ``bind_plans``: its bookings go into plans that name the slab id
    (:meth:`ShareDirectory.seal_plan`)."""
    recorded = ensure_share(settings, settings.geometry(chunk_bytes, ranks), wait_s)
    for rank in range(ranks):
        recorded.check_fits(chunk_bytes, rank)
    directory = ShareDirectory(
        settings.paths, geometry=recorded, namespace=namespace, tier=tier,
        timeout_s=settings.timeout_s, bind_plans=bind_plans,
    )  # fmt: skip
    directory.wait_ready(wait_s)
    return directory


def open_share_slab(
    settings: ShareSettings,
    *,
    chunk_bytes: int,
    rank: int,
    ranks: int,
    wait_s: float = 30.0,
) -> SharedSlab:
    """Worker ``rank``'s slab of the share (see the module docstring)."""
    recorded = ensure_share(settings, settings.geometry(chunk_bytes, ranks), wait_s)
    return SharedSlab(settings.paths, recorded, rank, chunk_bytes)


def open_share_lease(
    settings: ShareSettings, session: bytes, users: UsersHold | None = None
) -> Lease:
    """A worker's lease on its engine's session (close it when the worker ends); it
    refreshes the worker's ``users`` hold before each connection (see :mod:`.users`)."""
    return Lease(settings.paths, session, users=users)


class SessionLease:
    """A worker's lease on its engine's session at one node process, opened (with
    ``open_lease``) when a plan first names the session, before any job of that plan
    runs, and held until :meth:`close`; a later session (the scheduler half
    restarted) replaces it. Owned by the worker."""

    def __init__(self, open_lease: Callable[[bytes], Lease]) -> None:
        self._open = open_lease
        self.lease: Lease | None = None
        self.session: bytes | None = None

    def hold(self, session: bytes | None) -> None:
        if session is None or session == self.session:
            return
        old = self.lease
        self.lease = self._open(session)
        self.session = session
        if old is not None:
            old.close()

    def close(self) -> None:
        """Close the lease (idempotent; never raises past the lease's own close)."""
        if self.lease is not None:
            self.lease.close()
            self.lease = None
