"""A :class:`~kvoffload.testing.vllm_harness.fleet.SharedFleet`'s disk tier, shared by
its engines through a node process of its own (a *disk share*, decision 0017).

:class:`DiskShareWatch` finds the disk share once an engine opened it (its files are
named after ``disk_path`` and the namespace), watches it as the fleet watches the
host share (:class:`~.share_watch.ShareWatch`: an observer client, the share's
counts, its node process killed and stopped by pid), and checks:

- :meth:`check_bookings`: the disk share's slots being stored and pins are exactly
  the live engines' own (spills and the tier reads in flight they booked);
- :meth:`after_kill`: once the node process dropped a killed engine's session, none
  of the spills it had in flight is readable;
- :meth:`kill_node`: its node process SIGKILLed by pid; engines see misses, the next
  call starts a new one, which recovers the complete chunks from the slabs (every
  read verified) once no engine has a transfer of the dead one in flight;
- :meth:`quiescent`: nothing stored or pinned.

Every node process it saw is stopped by pid at :meth:`~.share_watch.ShareWatch.close`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from kvoffload.core.directory import LookupStatus
from kvoffload.core.keys import ChunkKey
from kvoffload.share.client import ShareDirectory
from kvoffload.testing.vllm_harness.checks import HarnessViolation
from kvoffload.testing.vllm_harness.harness import VllmHarness
from kvoffload.testing.vllm_harness.share_watch import Noticed, ShareWatch
from kvoffload.tiers.disk_backing import DiskBacking
from kvoffload.tiers.disk_files import FORMAT_DIR


def disk_directory(h: VllmHarness) -> ShareDirectory | None:
    """Engine ``h``'s client of the disk share (None: its disk tier is private)."""
    tier = h.scheduler_half.tiers.tier("disk")
    directory = getattr(tier, "directory", None)
    return directory if isinstance(directory, ShareDirectory) else None


class DiskShareWatch(ShareWatch):
    def __init__(self, disk_path: Path, share_root: Path, timeout_s: float) -> None:
        super().__init__("shared disk tier", DiskBacking.module, timeout_s)
        self.disk_path = disk_path
        self.share_root = share_root

    def find(self) -> None:
        """Find the disk share (after the first engine opened it) and connect."""
        if self.observer is not None:
            return
        (namespace,) = (self.disk_path / FORMAT_DIR).iterdir()  # one model
        backing = DiskBacking(self.disk_path, bytes.fromhex(namespace.name))
        self.attach(backing.paths(self.share_root))
        self.note_node()

    def note_node(self) -> None:
        """Remember the pid of the node process listening now (stopped at close)."""
        if self.counts() is not None:
            self.note_pid()

    def await_sessions(self, live: int) -> None:
        """Wait until the node process holds exactly the live engines' sessions and the
        observer's (a killed engine's dropped)."""
        want = live + 1
        self.wait(lambda: (c := self.counts()) is None or c.sessions == want, f"{want} sessions")

    def check_bookings(self, engines: list[VllmHarness]) -> None:
        """The disk share stores and pins exactly what the live engines booked at it.
        An engine's client moves bookings a node process lost to stale on its own
        (its lease thread, its next call), so the two are compared until they agree,
        bounded (``wait_for``); a disagreement that lasts is the violation."""

        def booked() -> tuple[int, int]:
            storing = pinned = 0
            for h in engines:
                directory = disk_directory(h)
                if directory is None:
                    raise HarnessViolation("an engine of the fleet has a private disk tier")
                current = directory.attachment.bookings.current
                storing += len(current.storing)
                pinned += current.pin_count
            return storing, pinned

        def agree() -> bool:
            c = self.counts()
            return c is None or (c.storing, c.pinned) == booked()

        with contextlib.suppress(HarnessViolation):
            self.wait(agree, "bookings agreeing")
        counts = self.counts()
        if counts is None:
            return
        storing, pinned = booked()
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

    def kill_live_node(self, live: list[VllmHarness]) -> bool:
        """SIGKILL the disk share's node process; wait until it is gone and every live
        engine's client noticed. False when none runs."""

        return self.kill_node(self.noticed(live))

    def noticed(self, live: list[VllmHarness]) -> Noticed:
        """Whether every live engine's client saw the node process of an identity go."""

        def noticed(dead: tuple[int, bytes]) -> bool:
            clients = [disk_directory(h) for h in live]
            return all(c is None or c.saw_go(dead) for c in clients)

        return noticed

    def quiescent(self) -> None:
        counts = self.counts() if self.observer is not None else None
        if counts is not None and (counts.storing or counts.pinned):
            raise HarnessViolation(
                f"not quiescent: the disk share has {counts.storing} slots storing and "
                f"{counts.pinned} pins"
            )
