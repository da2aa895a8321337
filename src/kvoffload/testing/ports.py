"""Loopback ports for test servers (redis-server, vllm serve, metrics endpoints)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
