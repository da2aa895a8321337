"""Helpers of the host-share tests: node processes served from a thread of the test
process, and engine stand-ins (``agent.py``) in processes of their own."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from kvoffload.core.config.typed import OffloadConfig
from kvoffload.core.keys import Namespace
from kvoffload.share.client import ShareDirectory
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.paths import SharePaths
from kvoffload.share.server import ShareServer
from kvoffload.share.server_start import open_server
from kvoffload.tiers.node_shares import NodeShare, open_node_directory
from kvoffload.tiers.registry import HOST
from kvoffload.tiers.spec import TierContext

AGENT = Path(__file__).with_name("agent.py")
NAMESPACE = Namespace("share-test@1", "layout", "bf16")


def host_share(
    extra: dict[str, object], *, chunk_bytes: int, ranks: int = 1, rank: int = 0
) -> NodeShare:
    """The host share ``extra`` (an engine's ``kv_connector_extra_config``) names, as
    the build opens it for an engine of ``ranks`` ranks whose chunks are ``chunk_bytes``
    per rank; ``ConfigError`` for a bad configuration."""
    config = OffloadConfig.from_dict(extra)
    ctx = TierContext(NAMESPACE, ranks, chunk_bytes, 0, eviction=config.eviction, rank=rank)
    share = HOST.node_share(config, ctx)
    assert share is not None, "the configuration names no host share"
    return share


def open_host_directory(share: NodeShare, wait_s: float = 30.0) -> ShareDirectory:
    """The scheduler half's directory of the host share (a new session), as the build
    opens it."""
    opened = open_node_directory("host", share, namespace=b"", session=os.urandom(16),
                                 wait_s=wait_s)  # fmt: skip
    return opened.directory


def serve_in_thread(
    paths: SharePaths, geometry: ShareGeometry
) -> tuple[ShareServer, threading.Thread]:
    """A node process of ``paths`` served from a thread of the test process."""
    server = open_server(paths, geometry)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread


def stop_thread(server: ShareServer, thread: threading.Thread) -> None:
    server.stop()
    thread.join()


class ThreadShares:
    """Node processes served from threads of the test process, and their clients."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.servers: list[tuple[ShareServer, threading.Thread]] = []
        self.clients: list[ShareDirectory] = []

    def serve(self, name: str, geometry: ShareGeometry) -> SharePaths:
        paths = SharePaths(name, self.root)
        self.servers.append(serve_in_thread(paths, geometry))
        return paths

    def client(self, paths: SharePaths, **options: object) -> ShareDirectory:
        options.setdefault("timeout_s", 30.0)
        options.setdefault("start_server", False)
        client = ShareDirectory(paths, **options)  # type: ignore[arg-type]
        self.clients.append(client)
        assert client.wait_ready(30.0)
        return client

    def close(self) -> None:
        for client in self.clients:
            client.close()
        for server, thread in self.servers:
            server.stop()
            thread.join()


class Agent:
    """``agent.py`` in its own process: one command, one answer line."""

    def __init__(self, paths: SharePaths, session: bytes) -> None:
        self.process = subprocess.Popen(
            [sys.executable, str(AGENT), str(paths.root), paths.name, session.hex()],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.ask(None) == "ready"

    @property
    def pid(self) -> int:
        return self.process.pid

    def ask(self, command: str | None) -> str:
        assert self.process.stdin is not None and self.process.stdout is not None
        if command is not None:
            self.process.stdin.write(command + "\n")
            self.process.stdin.flush()
        return self.process.stdout.readline().strip()

    def kill(self) -> None:
        """SIGKILL, and wait until it is gone (its sockets are closed by then)."""
        self.process.kill()
        self.process.wait()
