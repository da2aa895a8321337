"""Reaching a share's node process from an engine, whatever its backing.

An engine's processes open a share at start-up (the tiers' build does:
:mod:`kvoffload.tiers.node_shares`): whichever runs first starts the node process
(:func:`start_and_wait`); all wait for it (start-up only, up to ``wait_s``). A node
process that cannot serve (e.g. the share does not fit its root's free space) or
does not answer is a :class:`ConfigError` saying what it logged, its pid and what to
do (:class:`NotStarted`).

Sessions: the scheduler half draws a random session at each start. Each worker opens
a lease on it (:class:`SessionLease`) when it first learns it, from the scheduler
half's per-step metadata, before it runs any job of that plan: so the engine's
bookings stay held while any of its processes may still copy, and a restarted engine
never inherits (or releases) the bookings of its earlier life, whose workers may
linger. (An id derived from the configuration would not do: data-parallel replicas
share one configuration, and a restart keeps it.)
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvoffload.core.errors import ConfigError, KvOffloadError
from kvoffload.core.private_files import read_checked
from kvoffload.share.backing import Backing
from kvoffload.share.connection import connect
from kvoffload.share.launch import Spawned, server_alive, spawn_server
from kvoffload.share.lease import Lease
from kvoffload.share.lifecycle import recorded_pid
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.paths import SharePaths
from kvoffload.share.protocol import Role


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


@dataclass(frozen=True)
class Serving:
    """A node process answers: the share's recorded geometry, and whether the node
    process serving is the one this process started (the start-up lines)."""

    geometry: ShareGeometry
    started: bool


def start_and_wait(
    paths: SharePaths,
    geometry: ShareGeometry,
    wait_s: float,
    backing: Backing | None = None,
) -> Serving | NotStarted:
    """Start the share's node process (over ``backing``; shared-memory slabs when
    None) unless one serves it, and wait until one does (start-up only: this may
    wait ``wait_s``): what it serves, or what is known of the node process that did
    not come up. Its directories made first (:class:`ConfigError` naming
    ``host_share_root`` when another user made them)."""
    deadline = time.monotonic() + wait_s
    ready = False
    spawned: Spawned | None = None
    while True:
        opened = connect(paths, bytes(16), Role.LEASE, b"", 1.0)
        if opened is not None:
            opened[0].close()
            recorded = ShareGeometry.read(paths)
            if recorded is not None:
                started = (
                    ready and spawned is not None and recorded_pid(paths) == spawned.process.pid
                )
                return Serving(recorded, started)
        if ready or time.monotonic() >= deadline:
            return _not_started(paths, spawned, ready)
        spawned = spawn_server(paths, geometry, backing)
        if spawned is not None:
            ready = spawned.wait_ready(max(0.0, deadline - time.monotonic()))
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
