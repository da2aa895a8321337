"""A :class:`~kvoffload.testing.vllm_harness.fleet.SharedFleet`'s disk tier, shared by
its engines through a node process of its own (a *disk share*, decision 0017).

:class:`DiskShareWatch` finds the disk share once an engine opened it (its files are
named after ``disk_path`` and the namespace), watches it with an observer client of
its own (its own session, booking nothing), and checks, like the fleet does for the
host share:

- :meth:`check_bookings`: the disk share's slots being stored and pins are exactly
  the live engines' own (spills and the tier reads in flight they booked);
- :meth:`after_kill`: once the node process dropped a killed engine's session, none
  of the spills it had in flight is readable;
- :meth:`kill_node`: its node process SIGKILLed by pid; engines see misses, the next
  call starts a new one, which recovers the complete chunks from the slabs (every
  read verified) once no engine has a transfer of the dead one in flight;
- :meth:`quiescent`: nothing stored or pinned.

Every node process it saw is stopped by pid at :meth:`close`. Waits are bounded and
only for what the node process and the lease threads do on their own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from kvoffload.core.directory import LookupStatus
from kvoffload.core.keys import ChunkKey
from kvoffload.share.client import ShareDirectory
from kvoffload.share.launch import server_alive
from kvoffload.share.paths import SharePaths
from kvoffload.share.queries import ShareCounts
from kvoffload.testing.vllm_harness.checks import HarnessViolation
from kvoffload.testing.vllm_harness.harness import VllmHarness
from kvoffload.tiers.disk import FORMAT_DIR
from kvoffload.tiers.disk_backing import DiskBacking

WAIT_S = 30.0
"""The longest a fleet waits for a node process or a lease thread (a bug past it)."""


def wait_for(condition: Callable[[], bool], what: str) -> None:
    """Wait (bounded) for something another process or thread does on its own; a
    :class:`HarnessViolation` naming ``what`` past :data:`WAIT_S`."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise HarnessViolation(f"{what} not seen in {WAIT_S:.0f} s")
        time.sleep(0.002)


def _wait(condition: Callable[[], bool], what: str) -> None:
    wait_for(condition, f"shared disk tier: {what}")


def disk_directory(h: VllmHarness) -> ShareDirectory | None:
    """Engine ``h``'s client of the disk share (None: its disk tier is private)."""
    tier = h.scheduler_half.tiers.tier("disk")
    directory = getattr(tier, "directory", None)
    return directory if isinstance(directory, ShareDirectory) else None


class DiskShareWatch:
    def __init__(self, disk_path: Path, share_root: Path, timeout_s: float) -> None:
        self.disk_path = disk_path
        self.share_root = share_root
        self.timeout_s = timeout_s
        self.paths: SharePaths | None = None
        self.observer: ShareDirectory | None = None
        self.pids: set[int] = set()
        self.kills = 0

    def attach(self) -> None:
        """Find the disk share (after the first engine opened it) and connect."""
        if self.observer is not None:
            return
        (namespace,) = (self.disk_path / FORMAT_DIR).iterdir()  # one model
        backing = DiskBacking(self.disk_path, bytes.fromhex(namespace.name))
        self.paths = backing.paths(self.share_root)
        self.observer = ShareDirectory(
            self.paths, timeout_s=self.timeout_s, retry_s=0.0, start_server=False, lease=False
        )
        self.note_node()

    def counts(self) -> ShareCounts | None:
        """The disk share's counts, or None while no node process runs."""
        assert self.observer is not None and self.paths is not None
        if not server_alive(self.paths):
            return None
        found = self.observer.share_counts()
        if found is None:  # connected to a node process since killed
            found = self.observer.share_counts()
        if found is None:
            raise HarnessViolation("the disk share's node process does not answer")
        return found

    def note_node(self) -> None:
        """Remember the pid of the node process listening now (stopped at close)."""
        assert self.observer is not None
        if self.counts() is not None and self.observer.link.welcome is not None:
            self.pids.add(self.observer.link.welcome.pid)

    def await_sessions(self, live: int) -> None:
        """Wait until the node process holds exactly the live engines' sessions and the
        observer's (a killed engine's dropped)."""
        want = live + 1
        _wait(lambda: (c := self.counts()) is None or c.sessions == want, f"{want} sessions")

    def check_bookings(self, engines: list[VllmHarness]) -> None:
        counts = self.counts()
        if counts is None:
            return
        storing = pinned = 0
        for h in engines:
            directory = disk_directory(h)
            if directory is None:
                raise HarnessViolation("an engine of the fleet has a private disk tier")
            current = directory.attachment.bookings.current
            storing += len(current.storing)
            pinned += current.pin_count
        if (counts.storing, counts.pinned) != (storing, pinned):
            raise HarnessViolation(
                f"the disk share has {counts.storing} slots storing and {counts.pinned} "
                f"pins; the live engines booked {storing} and {pinned}"
            )

    def after_kill(self, spills: list[ChunkKey], live: list[VllmHarness]) -> None:
        """A killed engine's session is dropped and none of its spills is readable."""
        assert self.observer is not None
        self.await_sessions(len(live))
        if spills and self.counts() is not None:
            status = self.observer.lookup(spills).statuses
            readable = [k for k, s in zip(spills, status, strict=True) if s is LookupStatus.HIT]
            if readable:
                raise HarnessViolation(
                    f"{len(readable)} chunks a killed engine was spilling are readable on disk"
                )
        self.check_bookings(live)

    def kill_node(self, live: list[VllmHarness]) -> bool:
        """SIGKILL the disk share's node process; wait until it is gone and every live
        engine's client noticed. False when none runs."""
        assert self.observer is not None and self.paths is not None
        if self.counts() is None:
            return False
        welcome = self.observer.link.welcome
        assert welcome is not None
        if self._serves(welcome.pid):
            os.kill(welcome.pid, signal.SIGKILL)
        self.pids.discard(welcome.pid)
        paths = self.paths
        _wait(lambda: not server_alive(paths), "the disk node process's death")
        dead = welcome.generation

        def noticed() -> bool:
            clients = [disk_directory(h) for h in live]
            return all(c is None or c.attachment.generation != dead for c in clients)

        _wait(noticed, "the engines noticing the disk node process's death")
        self.kills += 1
        return True

    def quiescent(self) -> None:
        counts = self.counts() if self.observer is not None else None
        if counts is not None and (counts.storing or counts.pinned):
            raise HarnessViolation(
                f"not quiescent: the disk share has {counts.storing} slots storing and "
                f"{counts.pinned} pins"
            )

    def _serves(self, pid: int) -> bool:
        assert self.paths is not None
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        return b"kvoffload.tiers.disk_backing" in cmdline and self.paths.name.encode() in cmdline

    def close(self) -> None:
        """Stop every node process seen, and the one holding the server lock now, by
        pid (never raises)."""
        if self.observer is not None:
            welcome = self.observer.link.welcome
            if welcome is not None:
                self.pids.add(welcome.pid)
            self.observer.close()
        if self.paths is not None:
            with contextlib.suppress(OSError):
                holder = self.paths.server_lock.read_bytes()[:4]
                if len(holder) == 4:
                    self.pids.add(int.from_bytes(holder, "little"))
        for pid in self.pids:
            if self.paths is not None and self._serves(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if self.pids and self.paths is not None:
            paths = self.paths
            with contextlib.suppress(HarnessViolation):
                _wait(lambda: not server_alive(paths), "the disk node process's death")
