"""Test support for engines on a node-shared host tier (``host_share``): a share's
configuration under a private root, and stopping the node process an engine started
(:mod:`kvoffload.testing.share_process`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvoffload.testing.share_process import stop_node_process as stop_node_process_of


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
    """Stop the node process of the share ``extra`` names, and wait until it exited."""
    name, root = extra["host_share"], Path(extra["host_share_root"])
    assert stop_node_process_of(name, root, timeout_s), (
        f"the share {name!r}'s node process did not stop"
    )
