"""Each implementation of :class:`~kvoffload.core.directory.HostDirectory` as the
directory contract suite (and the directory state machine) meets it, by id:

- ``engine``: the engine's own :class:`~kvoffload.core.directory.Directory`;
- ``share``: a :class:`~kvoffload.share.client.ShareDirectory`, the client of a share
  whose node process serves from a thread of the test process (every directory made
  is a fresh share in a scratch root, without a lease);
- ``sim``: the simulator's :class:`~kvoffload.simulate.host_ledger.SharedHost`, one
  replica's.

:func:`directories` gives a factory that takes a :class:`Directory`'s arguments;
what it started (node process threads, clients, the scratch root) is stopped and
removed when its context exits, passed or failed. An implementation added needs an
entry in :data:`FACTORIES`."""

from __future__ import annotations

import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Protocol

from kvoffload.core.directory import Directory, HostDirectory
from kvoffload.core.directory.admission import MAX_ADMISSION_COUNTERS
from kvoffload.share.client import ShareDirectory
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.paths import SharePaths
from kvoffload.share.server_start import open_server
from kvoffload.simulate.host_ledger import SharedHost

CHUNK_BYTES = 64  # a share's slot size (the contract moves no bytes)


class MakeDirectory(Protocol):
    """A fresh, empty directory of one implementation."""

    def __call__(
        self,
        num_slots: int,
        *,
        tier: str = "host",
        policy: str = "lru",
        store_threshold: int = 1,
        max_admission_counters: int = MAX_ADMISSION_COUNTERS,
    ) -> HostDirectory: ...


def _engine(stack: ExitStack) -> MakeDirectory:
    return Directory


def _sim(stack: ExitStack) -> MakeDirectory:
    def make(
        num_slots: int,
        *,
        tier: str = "host",
        policy: str = "lru",
        store_threshold: int = 1,
        max_admission_counters: int = MAX_ADMISSION_COUNTERS,
    ) -> HostDirectory:
        return SharedHost(
            num_slots,
            1,
            policy=policy,
            store_threshold=store_threshold,
            tier=tier,
            max_admission_counters=max_admission_counters,
        )

    return make


def _share(stack: ExitStack) -> MakeDirectory:
    root = Path(tempfile.mkdtemp(prefix="kvd-", dir="/tmp"))  # short: socket paths
    stack.callback(shutil.rmtree, root, ignore_errors=True)
    made = 0

    def make(
        num_slots: int,
        *,
        tier: str = "host",
        policy: str = "lru",
        store_threshold: int = 1,
        max_admission_counters: int = MAX_ADMISSION_COUNTERS,
    ) -> HostDirectory:
        nonlocal made
        made += 1
        geometry = ShareGeometry(
            num_slots, CHUNK_BYTES, 1, policy, store_threshold, max_admission_counters
        )
        paths = SharePaths(f"contract{made}", root)
        server = open_server(paths, geometry)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        stack.callback(thread.join)
        stack.callback(server.stop)
        client = ShareDirectory(paths, tier=tier, timeout_s=30.0, start_server=False, lease=False)
        stack.callback(client.close)
        assert client.wait_ready(30.0)
        return client

    return make


FACTORIES: dict[str, Callable[[ExitStack], MakeDirectory]] = {
    "engine": _engine,
    "share": _share,
    "sim": _sim,
}
IMPLEMENTATIONS = tuple(FACTORIES)


@contextmanager
def directories(implementation: str) -> Iterator[MakeDirectory]:
    """A factory of fresh directories of ``implementation`` (an id of
    :data:`IMPLEMENTATIONS`); everything they hold is released on exit."""
    with ExitStack() as stack:
        yield FACTORIES[implementation](stack)
