"""A share's node process as a harness fleet watches it (test support): an observer
client of its own (its own session, booking nothing), the share's counts, killing its
node process by pid, stopping it with ``kvoffload share stop``'s verified stop,
seeing it leave files deleted under it, and stopping every node process it saw at
the end.

Used for the host share (:class:`~kvoffload.testing.vllm_harness.fleet.SharedFleet`)
and the shared disk tier (:mod:`.fleet_disk`). Waits are bounded (:func:`wait_for`)
and only for what node processes and lease threads do on their own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

from kvoffload.share.client import ShareDirectory
from kvoffload.share.connection import Welcome
from kvoffload.share.launch import server_alive
from kvoffload.share.lifecycle import recorded_pid, stop_share
from kvoffload.share.paths import SharePaths
from kvoffload.share.queries import ShareCounts
from kvoffload.testing.vllm_harness.checks import HarnessViolation

WAIT_S = 30.0
"""The longest a fleet waits for a node process or a lease thread (a bug past it)."""

Noticed = Callable[[tuple[int, bytes]], bool]
"""Whether every live engine saw the node process of this identity go."""


def wait_for(condition: Callable[[], bool], what: str) -> None:
    """Wait (bounded) for something another process or thread does on its own; a
    :class:`HarnessViolation` naming ``what`` past :data:`WAIT_S`."""
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise HarnessViolation(f"{what} not seen in {WAIT_S:.0f} s")
        time.sleep(0.002)


class ShareWatch:
    """One share (``label`` names it in violations), whose node process runs
    ``python -m module``; ``paths`` once known (:meth:`attach`, or given). Owns its
    observer and the pids of the node processes it saw."""

    def __init__(
        self, label: str, module: str, timeout_s: float, paths: SharePaths | None = None
    ) -> None:
        self.label = label
        self.module = module
        self.timeout_s = timeout_s
        self.paths = paths
        self.observer: ShareDirectory | None = None
        self.pids: set[int] = set()

    def attach(self, paths: SharePaths) -> None:
        """Connect the observer to the share at ``paths`` (its node process runs)."""
        self.paths = paths
        self.observer = ShareDirectory(
            paths,
            timeout_s=self.timeout_s,
            retry_s=0.0,
            start_server=False,
            lease=False,
            users=False,  # not an engine: a removal is refused for the engines alone
            fence=False,  # it books nothing: it never fences a new node process
        )

    def wait(self, condition: Callable[[], bool], what: str) -> None:
        wait_for(condition, f"{self.label}: {what}")

    def counts(self) -> ShareCounts | None:
        """The whole share's counts (the observer's call; its session included), or
        None while no node process runs."""
        assert self.observer is not None and self.paths is not None
        if not server_alive(self.paths):
            return None
        found = self.observer.share_counts()
        if found is None:  # its connection was to a node process since killed
            found = self.observer.share_counts()
        if found is None:
            raise HarnessViolation(f"the {self.label}'s node process does not answer")
        return found

    def note_pid(self) -> None:
        """Remember the pid of the node process the observer is connected to."""
        assert self.observer is not None
        welcome = self.observer.link.welcome
        if welcome is not None:
            self.pids.add(welcome.pid)

    def running(self) -> Welcome | None:
        """The node process serving now (the observer connected to it), or None."""
        if self.counts() is None:
            return None
        assert self.observer is not None
        return self.observer.link.welcome

    def kill_node(self, noticed: Noticed) -> bool:
        """SIGKILL the node process by pid; wait until it is gone and ``noticed(its
        identity)`` holds (the engines saw it die). False when none runs."""
        welcome = self.running()
        if welcome is None:
            return False
        if self.serves(welcome.pid):
            os.kill(welcome.pid, signal.SIGKILL)
        self.pids.discard(welcome.pid)
        paths = self.paths
        assert paths is not None
        self.wait(lambda: not server_alive(paths), "the node process's death")
        self.wait(lambda: noticed(welcome.identity), "the engines noticing its death")
        return True

    def stop_node(self, noticed: Noticed) -> bool:
        """``kvoffload share stop`` (the verified stop: it waits until the node process
        exited); wait until the engines noticed. False when none runs; a refusal is a
        :class:`HarnessViolation`."""
        welcome = self.running()
        if welcome is None:
            return False
        assert self.paths is not None
        code, line = stop_share(self.paths)
        if code != 0 or server_alive(self.paths):
            raise HarnessViolation(f"{self.label}: share stop did not stop it: {line}")
        self.pids.discard(welcome.pid)
        self.wait(lambda: noticed(welcome.identity), "the engines noticing the stop")
        return True

    def left_deleted_files(self, welcome: Welcome | None, noticed: Noticed) -> None:
        """The share's directory was deleted under the node process ``welcome`` names
        (None: none ran): it notices at its next ``prepare_store`` (the observer's,
        here, so that the schedule does not depend on its once-a-second check) and
        exits; wait until it did and the engines noticed."""
        if welcome is None or not self.serves(welcome.pid):
            return
        assert self.observer is not None
        self.observer.prepare_store([])  # answered by an error: its files are gone
        self.wait(lambda: not self.serves(welcome.pid), "the node process leaving")
        self.pids.discard(welcome.pid)
        self.wait(lambda: noticed(welcome.identity), "the engines noticing it left")

    def serves(self, pid: int) -> bool:
        """Whether ``pid`` is this share's node process still (never another's)."""
        if self.paths is None:
            return False
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        return self.module.encode() in cmdline and self.paths.name.encode() in cmdline

    def close(self) -> None:
        """Close the observer; stop every node process seen, and the one holding the
        server lock now, by pid, and wait until none serves (never raises)."""
        if self.observer is not None:
            self.note_pid()
            self.observer.close()
        if self.paths is None:
            return
        holder = recorded_pid(self.paths)
        if holder is not None:
            self.pids.add(holder)
        for pid in self.pids:
            if self.serves(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        paths = self.paths
        with contextlib.suppress(HarnessViolation):
            self.wait(lambda: not server_alive(paths), "the node process's death")
