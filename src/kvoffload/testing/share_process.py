"""Stopping a share's node process from a test or a benchmark: an engine starts it
detached (it outlives the engine), so it is not the caller's child; it is stopped
as ``kvoffload share stop`` stops it (:func:`~kvoffload.share.lifecycle.stop_share`:
the process verified, signalled through a pidfd, waited for)."""

from __future__ import annotations

from pathlib import Path

from kvoffload.share.lifecycle import stop_share
from kvoffload.share.paths import SharePaths


def stop_node_process(
    name: str, root: Path, timeout_s: float = 30.0, group: int | None = None
) -> bool:
    """Stop the node process serving share ``name`` under ``root``, if one is, and
    wait until it exited. Returns whether it exited within ``timeout_s`` (True when
    none was serving); False too when it could not be verified (nothing signalled)."""
    code, _ = stop_share(SharePaths(name, root, group), timeout_s)
    return code == 0
