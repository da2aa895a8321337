"""Opening a share from an engine's ``kv_connector_extra_config``.

Keys read (``host_share`` switches the share on; the others keep their meaning):

- ``host_share``: the share's name (letters, digits, ``_.-``);
- ``cpu_bytes``: the share's size, all ranks together, when this engine creates it;
- ``eviction``, ``store_threshold``: its policy and admission, when this engine
  creates it (a share keeps those of its creator);
- ``host_share_timeout_ms`` (default 5): the deadline of one directory call;
- ``host_share_root`` (default ``/dev/shm``): where its files live.

The scheduler half calls :func:`open_share_directory`, each worker
:func:`open_share_slab` at start-up; whichever runs first starts the node process;
both wait for it (start-up only, up to ``wait_s``) and check that the engine's chunks
fit the share (:class:`ConfigError` otherwise).

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
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvoffload.core.errors import ConfigError
from kvoffload.share.backing import Backing
from kvoffload.share.client import ShareDirectory
from kvoffload.share.geometry import ShareGeometry
from kvoffload.share.launch import spawn_server
from kvoffload.share.link import Lease, connect
from kvoffload.share.paths import DEFAULT_ROOT, SharePaths
from kvoffload.share.protocol import Role
from kvoffload.share.slab import SharedSlab


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
        return cls(
            SharePaths(str(name), root),
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
    A node process this engine started that does not come up is a :class:`ConfigError`."""
    recorded = start_and_wait(settings.paths, geometry, wait_s)
    if recorded is None:
        raise ConfigError("host_share", f"share {settings.paths.name!r} did not start")
    return recorded


def start_and_wait(
    paths: SharePaths,
    geometry: ShareGeometry,
    wait_s: float,
    backing: Backing | None = None,
) -> ShareGeometry | None:
    """:func:`ensure_share`'s work for any share (a backed share's with
    its ``backing``): the recorded geometry, or None when no node process came up."""
    deadline = time.monotonic() + wait_s
    started = False
    while True:
        opened = connect(paths, bytes(16), Role.LEASE, b"", 1.0)
        if opened is not None:
            opened[0].close()
            recorded = ShareGeometry.read(paths.meta)
            if recorded is not None:
                return recorded
        if started or time.monotonic() >= deadline:
            return None
        spawned = spawn_server(paths, geometry, backing)
        if spawned is not None:
            started = spawned.wait_ready(max(0.0, deadline - time.monotonic()))
            spawned.close()
        else:
            time.sleep(0.02)  # another process is starting it: look again shortly


def open_share_directory(
    settings: ShareSettings,
    *,
    chunk_bytes: int,
    ranks: int,
    namespace: bytes = b"",
    tier: str = "host",
    wait_s: float = 30.0,
) -> ShareDirectory:
    """The scheduler half's directory of the share (see the module docstring)."""
    recorded = ensure_share(settings, settings.geometry(chunk_bytes, ranks), wait_s)
    for rank in range(ranks):
        recorded.check_fits(chunk_bytes, rank)
    directory = ShareDirectory(
        settings.paths, geometry=recorded, namespace=namespace, tier=tier,
        timeout_s=settings.timeout_s,
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


def open_share_lease(settings: ShareSettings, session: bytes) -> Lease:
    """A worker's lease on its engine's session (close it when the worker ends)."""
    return Lease(settings.paths, session)


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
