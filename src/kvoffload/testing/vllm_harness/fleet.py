"""Several harness engines over one node-shared host tier (``host_share``, decision 0016).

A :class:`SharedFleet` runs N :class:`VllmHarness` engines (each its own vLLM
scheduler, kvoffload connector halves and KV model) naming one share: a unique share
name in a directory of the fleet's own (``host_share_root``). The node process is
started by the first engine, as in production, and every node process the fleet saw
is stopped by pid at :meth:`SharedFleet.close`, whatever happened.

What is checked, beyond each engine's own checks at every step:

- cross-engine loads: the KV model is a function of the token content (and the
  weights version, equal everywhere), so an engine loading a chunk another engine
  stored is checked to get exactly the KV that engine computed for that prefix;
- provenance is fleet-wide: a load names only chunks some engine planned to store
  since the last node-process start, never a store a killed engine had in flight;
- :meth:`kill` (an engine SIGKILLed): its copies stop, its connections close
  without any completion, and once the node process has dropped its session the
  share's stores and pins are exactly the live engines' own, and none of its
  in-flight stores is readable;
- :meth:`kill_node` (the node process SIGKILLed by pid): engines see misses, never
  wrong KV nor an exception, and recover with a node process one of them starts;
- share-lifecycle faults (:mod:`.share_faults`: ``kvoffload share stop`` then a
  refused ``remove``; the share root's per-user directory deleted wholesale): engines
  go on, start a node process themselves, and their workers move to new slab files
  (or fail the jobs of plans that name another): never wrong KV;
- :meth:`quiescent`: nothing is stored or pinned anywhere in the share;
- with vLLM's KV events on (``spec.kv_events``), after every step: each engine
  announces exactly what the shares hold, and its published events say so
  (:mod:`.announce_watch`).

Determinism: the share's call deadline is generous (:data:`CALL_TIMEOUT_MS`, so a
loaded machine never turns a call into a miss), each engine's link retries on its
harness's logical clock, and the fleet waits (bounded) at step boundaries for what
the node process and the lease threads do on their own: a new node process
listening, a dead session dropped, a death noticed. Owns its engines, its share's
directory and an observer client of the share (its own session, booking nothing).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import replace
from pathlib import Path

from kvoffload.core.directory import LookupStatus
from kvoffload.core.keys import ChunkKey
from kvoffload.share.client import ShareDirectory
from kvoffload.share.paths import SharePaths
from kvoffload.share.queries import ShareCounts
from kvoffload.testing.vllm_harness.announce_watch import check_announcements
from kvoffload.testing.vllm_harness.checks import HarnessViolation
from kvoffload.testing.vllm_harness.fleet_disk import DiskShareWatch, disk_directory
from kvoffload.testing.vllm_harness.harness import VllmHarness
from kvoffload.testing.vllm_harness.records import StepRecord
from kvoffload.testing.vllm_harness.share_watch import WAIT_S, ShareWatch
from kvoffload.testing.vllm_harness.sigkill import sigkill, spills_in_flight
from kvoffload.testing.vllm_harness.spec import HarnessSpec

CALL_TIMEOUT_MS = 10_000
"""``host_share_timeout_ms`` of every engine: far past any call on a loaded machine,
so no deadline decides an outcome (a dead node process fails calls at once)."""


def _sessions(counts: ShareCounts | None) -> int | None:
    return None if counts is None else counts.sessions


def _remaps(h: VllmHarness) -> int:
    """Times the workers of engine ``h`` mapped the share's new slab files."""
    shares = [child.side.share for entry in h.ranks for child in entry.children]
    return sum(share.remaps for share in shares if share is not None)


class SharedFleet:
    def __init__(self, model_path: Path, spec: HarnessSpec, engines: int) -> None:
        """``engines`` engines of ``spec`` over one new share of ``spec.cpu_bytes``;
        with ``disk_bytes`` in its ``extra``, over one disk tier too, in the fleet's
        directory, shared through its own node process (:mod:`.fleet_disk`); with
        ``redis_url``, over one Redis server (shared by nature)."""
        self.model_path = model_path
        self.root = Path(tempfile.mkdtemp(prefix="kvoffload-fleet-"))
        self.paths = SharePaths(f"fleet{os.getpid()}x{id(self) % 100000}", self.root)
        extra = {
            **spec.extra,
            "host_share": self.paths.name,
            "host_share_root": str(self.root),
            "host_share_timeout_ms": CALL_TIMEOUT_MS,
        }
        self.disk: DiskShareWatch | None = None
        if "disk_bytes" in extra:
            extra["disk_path"] = str(self.root / "disk")
            self.disk = DiskShareWatch(self.root / "disk", self.root, CALL_TIMEOUT_MS / 1000)
        self.spec = replace(spec, extra=extra)
        self.stored: set[ChunkKey] = set()  # planned stores since the node process started
        self.spilled: set[ChunkKey] = set()  # planned spills to a shared lower tier
        self.stored_by: dict[ChunkKey, str] = {}  # the engine incarnation that stored it
        self.stats: Counter[str] = Counter()
        self.announcements_checked = 0  # engine-tier pairs (spec.kv_events)
        # the host share: its observer, the node processes seen (stopped at close)
        timeout_s = CALL_TIMEOUT_MS / 1000
        self.host = ShareWatch("shared host tier", "kvoffload.share.serve", timeout_s, self.paths)
        self.engines: list[VllmHarness | None] = []
        self.names: list[str] = []  # each engine's incarnation ("e1", "e1'", ...)
        self.retired: list[VllmHarness] = []  # killed engines (their loads checked count)
        self._identities: dict[int, tuple[int, bytes]] = {}  # each engine's node process
        self._killed_remaps = 0  # slab remaps of the workers of killed engines
        try:
            for i in range(engines):
                self.engines.append(self._start(i))
                self.names.append(f"e{i}")
            self.host.attach(self.paths)
            self._note_node()
            if self.disk is not None:
                self.disk.find()
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ engines

    def _start(self, index: int) -> VllmHarness:
        h = VllmHarness(self.model_path, self.spec)
        shared_below = self.disk is not None or "redis_url" in self.spec.extra
        spilled = self.spilled if shared_below else None  # one tier below for all engines
        for unit in h.units:
            unit.checks.share_stored(self.stored, spilled)
        share = h.side.share
        if share is None:
            raise HarnessViolation("an engine of the fleet opened no host share")
        links = [share.directory.link]
        if self.disk is not None:
            disk = disk_directory(h)
            if disk is None:
                raise HarnessViolation("an engine of the fleet has a private disk tier")
            links.append(disk.link)
        for link in links:
            link.clock = lambda: h.clock  # retries in logical time
            link._next_attempt = 0.0
        return h

    def engine(self, index: int) -> VllmHarness:
        h = self.engines[index]
        if h is None:
            raise HarnessViolation(f"engine {index} is dead")
        return h

    def alive(self, index: int) -> bool:
        return self.engines[index] is not None

    def live(self) -> list[VllmHarness]:
        return [h for h in self.engines if h is not None]

    def step(self, index: int, complete: bool = True) -> StepRecord | None:
        """One engine-loop call of engine ``index``; cross-engine loads counted."""
        h = self.engine(index)
        record = h.step(complete=complete)
        if record is not None:
            me = self.names[index]
            for load in record.plan.loads:
                owners = {self.stored_by.get(k) for k in load.keys}
                if any(o is not None and o.split("'")[0] != me.split("'")[0] for o in owners):
                    self.stats["cross_engine_loads"] += 1
                elif any(o is not None and o != me for o in owners):
                    self.stats["restart_loads"] += 1  # stored by its killed incarnation
            for store in record.plan.stores:
                self.stored_by.update(dict.fromkeys(store.keys, me))
        share = h.side.share
        spawned = share.directory.link.spawned if share is not None else None
        if spawned is not None and spawned.ready_fd >= 0:  # it started a node process
            spawned.wait_ready(WAIT_S)
            self._note_node()
        disk = disk_directory(h) if self.disk is not None else None
        spawned = disk.link.spawned if disk is not None else None
        if self.disk is not None and spawned is not None and spawned.ready_fd >= 0:
            spawned.wait_ready(WAIT_S)  # it started the disk share's node process
            self.disk.note_node()
        self._note_generation(index)
        if self.spec.kv_events:
            self.announcements_checked += check_announcements(self.live())
        return record

    def _note_generation(self, index: int) -> None:
        h = self.engines[index]
        share = h.side.share if h is not None else None
        welcome = share.directory.link.welcome if share is not None else None
        if welcome is None:
            return
        before = self._identities.get(index)
        if before is not None and welcome.identity != before:
            self.stats["recoveries"] += 1  # attached to a node process started since
        self._identities[index] = welcome.identity

    # ------------------------------------------------------------ the share

    @property
    def observer(self) -> ShareDirectory | None:
        """The host share's observer client (its own session, booking nothing)."""
        return self.host.observer

    def counts(self) -> ShareCounts | None:
        """The whole share's counts (the observer's call; its session included), or
        None while no node process runs (killed, not restarted yet: nothing is
        readable, stored or pinned)."""
        return self.host.counts()

    def _note_node(self) -> None:
        """Wait until every live engine's session is open at the node process now
        listening (its leases reconnect on their own); remember its pid."""
        want = len(self.live()) + 1  # and the observer's
        self.host.wait(lambda: (_sessions(self.counts()) or 0) >= want, f"{want} sessions")
        self.host.note_pid()

    def own_bookings(self) -> tuple[int, int]:
        """(storing, pinned) the live engines booked at the node process now running
        (bookings left from a killed one are stale: they settle on completion)."""
        storing = pinned = 0
        for h in self.live():
            share = h.side.share
            assert share is not None
            current = share.directory.attachment.bookings.current
            storing += len(current.storing)
            pinned += current.pin_count
        return storing, pinned

    def check_bookings(self) -> None:
        """The share stores and pins exactly what the live engines booked."""
        counts = self.counts()
        if counts is None:
            return
        storing, pinned = self.own_bookings()
        if (counts.storing, counts.pinned) != (storing, pinned):
            raise HarnessViolation(
                f"the share has {counts.storing} slots storing and {counts.pinned} pins; "
                f"the live engines booked {storing} and {pinned}"
            )

    # ------------------------------------------------------------ kills

    def kill(self, index: int) -> list[ChunkKey]:
        """Engine ``index`` SIGKILLed, as one process can do it (``sigkill.py``), then
        checked once the node process dropped its session: none of its in-flight
        stores is readable and the share's bookings are the live engines'. Returns
        the keys of those stores."""
        h = self.engine(index)
        spills = spills_in_flight(h)
        self._killed_remaps += _remaps(h)
        keys = sigkill(h)
        self.engines[index] = None
        self.retired.append(h)
        self._identities.pop(index, None)
        self.stored.difference_update(keys)
        self.stats["engine_kills"] += 1
        self._await_sessions()  # (the observer is connected now)
        assert self.observer is not None
        readable: list[ChunkKey] = []
        if keys and self.counts() is not None:  # (none runs: nothing is readable)
            status = self.observer.lookup(keys).statuses
            readable = [k for k, s in zip(keys, status, strict=True) if s is not LookupStatus.MISS]
        if readable:
            raise HarnessViolation(
                f"{len(readable)} chunks a killed engine was storing are readable"
            )
        self.check_bookings()
        if self.disk is not None:
            self.disk.after_kill(spills, self.live())
        return keys

    def restart(self, index: int) -> VllmHarness:
        """A new engine in place of killed engine ``index`` (a new session, the same
        namespace)."""
        if self.engines[index] is not None:
            raise HarnessViolation(f"engine {index} is alive")
        self.engines[index] = h = self._start(index)
        self.names[index] += "'"
        self.stats["engine_restarts"] += 1
        self._note_node()
        return h

    def _await_sessions(self) -> None:
        """Wait until the node process dropped every dead engine's session."""
        want = len(self.live()) + 1
        self.host.wait(lambda: _sessions(self.counts()) in (want, None), f"{want} sessions")

    def kill_node(self) -> None:
        """SIGKILL the node process by pid and wait until it is gone and every live
        engine's lease noticed; it restarts when an engine calls next."""

        if not self.host.kill_node(self.noticed):
            return  # none runs
        self.stored.clear()  # a new node process starts empty
        self.stats["node_kills"] += 1

    def noticed(self, dead: tuple[int, bytes]) -> bool:
        """Every live engine saw the node process of identity ``dead`` go."""
        shares = [h.side.share for h in self.live()]
        return all(s is None or s.directory.saw_go(dead) for s in shares)

    @property
    def slab_remaps(self) -> int:
        """Times a worker of any engine (alive or killed) mapped new slab files."""
        return self._killed_remaps + sum(_remaps(h) for h in self.live())

    def kill_disk_node(self) -> None:
        """SIGKILL the shared disk tier's node process (see :mod:`.fleet_disk`); the
        chunks it held stay on disk, recovered by the next one."""
        if self.disk is not None and self.disk.kill_live_node(self.live()):
            self.stats["disk_node_kills"] += 1

    # ------------------------------------------------------------ the end

    def quiescent(self) -> None:
        """Every live engine quiescent, nothing stored or pinned in the share."""
        for h in self.live():
            h.quiescent()
        if self.disk is not None:
            self.disk.quiescent()
        counts = self.counts()
        if counts is not None and (counts.storing or counts.pinned):
            raise HarnessViolation(
                f"not quiescent: the share has {counts.storing} slots storing and "
                f"{counts.pinned} pins"
            )

    @property
    def loads_checked(self) -> int:
        return sum(h.loads_checked for h in (*self.live(), *self.retired))

    def close(self) -> None:
        """Close the live engines, stop every node process seen by pid, remove the
        share's files (never raises past a failed engine)."""
        for h in self.live():
            with contextlib.suppress(Exception):  # the share must still be stopped
                h.close()
        self.engines = [None] * len(self.engines)
        self.host.close()
        if self.disk is not None:
            self.disk.close()
        shutil.rmtree(self.root, ignore_errors=True)
