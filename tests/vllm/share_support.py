"""Test support for engines on a node-shared host tier (``host_share``): a share's
configuration under a private root, and stopping the node process an engine started
(detached, so not the test's child) by its pid."""

from __future__ import annotations

import os
import select
import signal
from pathlib import Path
from typing import Any

from kvoffload.share.launch import server_alive
from kvoffload.share.paths import SharePaths


def share_config(root: Path, name: str, cpu_bytes: int) -> dict[str, Any]:
    """``kv_connector_extra_config`` entries for a share ``name`` under ``root``. The
    call deadline is generous: the test machine's cores are busy, and a timed-out
    call (a miss by design) must not decide what a test observes."""
    root.mkdir(parents=True, exist_ok=True)
    return {
        "cpu_bytes": cpu_bytes,
        "host_share": name,
        "host_share_root": str(root),
        "host_share_timeout_ms": 2000,
    }


def stop_node_process(extra: dict[str, Any], timeout_s: float = 30.0) -> None:
    """SIGTERM the share's node process, if one is serving, and wait until it exited
    (its pid from the server lock file; waited on through a pidfd, not polled)."""
    paths = SharePaths(extra["host_share"], Path(extra["host_share_root"]))
    if not server_alive(paths):
        return
    pid = int.from_bytes(paths.server_lock.read_bytes()[:4], "little")
    exited = os.pidfd_open(pid)
    try:
        os.kill(pid, signal.SIGTERM)
        ready, _, _ = select.select([exited], [], [], timeout_s)
        assert ready, f"the share's node process {pid} did not stop"
    finally:
        os.close(exited)
