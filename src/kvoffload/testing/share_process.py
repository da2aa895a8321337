"""Stopping a share's node process from a test or a benchmark: an engine starts it
detached (it outlives the engine), so it is not the caller's child and is stopped by
the pid its server lock file records."""

from __future__ import annotations

import os
import select
import signal
from pathlib import Path

from kvoffload.share.launch import server_alive
from kvoffload.share.paths import SharePaths


def stop_node_process(name: str, root: Path, timeout_s: float = 30.0) -> bool:
    """SIGTERM the node process serving share ``name`` under ``root``, if one is,
    and wait until it exited (through a pidfd, not polled). Returns whether it exited
    within ``timeout_s`` (True when none was serving)."""
    paths = SharePaths(name, root)
    if not server_alive(paths):
        return True
    pid = int.from_bytes(paths.server_lock.read_bytes()[:4], "little")
    exited = os.pidfd_open(pid)
    try:
        os.kill(pid, signal.SIGTERM)
        ready, _, _ = select.select([exited], [], [], timeout_s)
        return bool(ready)
    finally:
        os.close(exited)
