"""The node-shared host tier (``host_share``, decision 0016) as the connector's two
halves open it.

- :func:`share_settings`: the share named by the configuration, or None. Lower
  tiers work under a share: the tier planner books host chunks through calls that
  answer a miss when the share does not (``core/tiering/planning.py``), a disk tier is
  shared by the node's engines through a node process of its own
  (``tiers/disk_shared.py``, decision 0017), and a Redis tier is shared by nature;
- :func:`open_scheduler_share`: the scheduler half's directory of the share
  (:class:`~kvoffload.share.client.ShareDirectory`), whose random ``session`` goes to
  the workers in every step's metadata;
- :class:`WorkerShare`: a worker's view: its rank's shared slab, and the lease on
  its engine's session, opened when a plan first names the session, before any job
  of that plan runs, and held until the worker shuts down; before any job of a plan
  runs it also checks that its slab is the one the plan names (:meth:`WorkerShare.admit`,
  decision 0018);
- :class:`LinkCounters`: the link's counters as the metric
  ``host_share_calls_total``.

Whichever half runs first starts the share's node process (in vLLM the workers
register their KV caches before the scheduler is built): :func:`start_node_process`,
whose answer (``started``: this process's node process is the one serving) goes into
the start-up lines.
Ownership: the scheduler half owns its :class:`ShareDirectory` (closed at shutdown);
each worker owns its :class:`WorkerShare`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvoffload.core.config.typed import OffloadConfig
from kvoffload.core.errors import KvOffloadError
from kvoffload.core.keys import Namespace
from kvoffload.core.observe.recorder import MetricsRecorder
from kvoffload.share.launch import spawn_server
from kvoffload.share.lifecycle import recorded_pid
from kvoffload.share.opening import (
    SessionLease,
    ShareSettings,
    open_share_directory,
    open_share_lease,
    open_share_slab,
)
from kvoffload.share.users import UsersHold

if TYPE_CHECKING:
    from kvoffload.share.client import ShareDirectory
    from kvoffload.share.slab import SharedSlab

START_WAIT_S = 30.0
"""How long an engine start waits for the node process it started to listen."""

LINK_OUTCOMES = ("connects", "unavailable", "timeouts", "lost", "errors", "server_starts")
"""The link's counters (``share.link.Link.stats``) exported per ``outcome``."""


def start_node_process(settings: ShareSettings, chunk_bytes: int, ranks: int) -> bool:
    """Start the share's node process unless one serves it, and wait until one does
    (start-up only); whether the one serving is the one this process started (of
    several engines starting it at once, one serves, the others' exit at once)."""
    spawned = spawn_server(settings.paths, settings.geometry(chunk_bytes, ranks))
    if spawned is None:
        return False
    try:
        if not spawned.wait_ready(START_WAIT_S):
            return False  # opening the share reports what is wrong
        return recorded_pid(settings.paths) == spawned.process.pid
    finally:
        spawned.close()


def share_settings(config: OffloadConfig) -> ShareSettings | None:
    """The share ``config`` names (None: a private host tier; a bad value is a
    ConfigError naming its option)."""
    if config.host_share is None:
        return None
    settings = ShareSettings.from_config(
        {
            "host_share": config.host_share,
            "cpu_bytes": config.cpu_bytes,
            "eviction": config.eviction,
            "store_threshold": config.store_threshold,
            "host_share_timeout_ms": config.host_share_timeout_ms,
            "host_share_root": config.host_share_root,
            "host_share_group": config.host_share_group,
        }
    )
    assert settings is not None  # host_share is set
    return settings


@dataclass
class SchedulerShare:
    """The scheduler half's share: its directory, and whether this process started
    the node process (the start-up line)."""

    settings: ShareSettings
    directory: ShareDirectory
    started: bool

    def describe(self) -> str:
        """The share's part of the start-up line."""
        welcome = self.directory.link.welcome
        generation = welcome.generation if welcome is not None else "?"
        pid = welcome.pid if welcome is not None else "?"
        who = "started by this engine" if self.started else "found running"
        return (
            f"host share {self.settings.paths.name!r} in {self.settings.paths.root} "
            f"(generation {generation}, node process pid {pid}, {who})"
        )


def open_scheduler_share(
    settings: ShareSettings, *, chunk_bytes: int, ranks: int, namespace: Namespace
) -> SchedulerShare:
    """Open (starting it if need be) the share's directory for the scheduler half;
    ConfigError when the engine's chunks do not fit the share's slots."""
    started = start_node_process(settings, chunk_bytes, ranks)
    directory = open_share_directory(
        settings,
        chunk_bytes=chunk_bytes,
        ranks=ranks,
        namespace=namespace.digest(),
        bind_plans=True,  # every plan names the slab its jobs move bytes of
    )
    return SchedulerShare(settings, directory, started)


class WorkerShare:
    """One worker's share: its rank's slab, its hold on the share's ``users.lock``
    (``kvoffload share remove`` refuses while it is held) and, once known, the lease
    on its engine's session (see the module docstring)."""

    def __init__(self, settings: ShareSettings, *, chunk_bytes: int, rank: int, ranks: int) -> None:
        self.settings = settings
        self.started = start_node_process(settings, chunk_bytes, ranks)
        self.users = UsersHold(settings.paths)
        try:
            self.slab: SharedSlab = open_share_slab(
                settings, chunk_bytes=chunk_bytes, rank=rank, ranks=ranks
            )
        except BaseException:
            self.users.release()
            raise
        self.lease = SessionLease(lambda session: open_share_lease(settings, session, self.users))
        self.remaps = 0  # times the slab was remapped to the share's new files

    def hold(self, session: bytes | None) -> None:
        """Hold a lease on ``session`` (from a plan's metadata) before running its
        jobs; a later session (the scheduler half restarted) replaces it."""
        self.lease.hold(session)

    def admit(self, slab_id: bytes | None, busy: Callable[[], bool]) -> str | None:
        """Before any job of a plan naming ``slab_id`` runs: None when this worker's
        slab is that one, else why the plan's jobs that touch host slots must fail.

        When the share's rank file now carries ``slab_id`` (its files were made anew)
        and nothing of this worker is in flight on the old mapping (``busy()`` False:
        those copies belong to a node process that is gone, and are settled by the
        scheduler half, never made readable), the slab is remapped to it first, and
        the ``users.lock`` hold taken again in the new directory. Never raises."""
        slab = self.slab
        if slab_id == slab.slab_id:
            return None
        if slab_id is None:
            return "host share: the plan names no slab (no node process answered)"
        if slab.file_slab_id() != slab_id:
            return (
                f"host share: the plan's slab {slab_id.hex()} is not the share's file "
                f"{slab.paths.slab(slab.rank)} (its node process was replaced)"
            )
        if busy():
            return "host share: copies on the share's old slab are still in flight"
        try:
            remapped = slab.remap(slab_id)
        except (OSError, KvOffloadError) as exc:  # (a CUDA registration refused, say)
            return f"host share: remapping the slab failed ({exc})"
        if not remapped:
            return f"host share: the slab {slab_id.hex()} could not be mapped"
        self.remaps += 1
        with contextlib.suppress(OSError, KvOffloadError):
            self.users.refresh()
        return None

    def close(self) -> None:
        """Close the lease, unmap this worker's view of the slab and release the
        ``users.lock`` hold (never raises)."""
        self.lease.close()
        self.slab.close()
        self.users.release()


class LinkCounters:
    """Moves the link's counters (``Link.stats``, counted by the link itself) into the
    scheduler half's recorder as ``host_share_calls_total{outcome}``; owned by the
    scheduler half, called under its lock before each metrics reading."""

    def __init__(self, recorder: MetricsRecorder) -> None:
        self.recorder = recorder
        self.seen: dict[str, int] = dict.fromkeys(LINK_OUTCOMES, 0)
        for outcome in LINK_OUTCOMES:
            recorder.declare("host_share_calls_total", outcome=outcome)

    def sync(self, stats: Mapping[str, int]) -> None:
        """Count what the link counted since the last call."""
        for outcome in LINK_OUTCOMES:
            now = stats.get(outcome, 0)
            if now > self.seen[outcome]:
                self.recorder.count(
                    "host_share_calls_total", now - self.seen[outcome], outcome=outcome
                )
                self.seen[outcome] = now
