"""Fixtures of the host-share tests: a short scratch directory (Unix socket paths are
limited to 107 bytes), node processes in a thread of the test process
(:class:`ThreadShares`) or in a process of their own, and engine stand-ins
(:class:`Agent`). Every process a test starts is killed by pid at teardown, passed
or failed."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from share_fixtures import Agent, ThreadShares

from kvoffload.share.launch import Spawned, spawn_server
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.paths import SharePaths


@pytest.fixture
def share_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def shares(share_root: Path) -> Iterator[ThreadShares]:
    shares = ThreadShares(share_root)
    try:
        yield shares
    finally:
        shares.close()


@pytest.fixture
def agents() -> Iterator[Callable[[SharePaths, bytes], Agent]]:
    started: list[Agent] = []

    def start(paths: SharePaths, session: bytes) -> Agent:
        agent = Agent(paths, session)
        started.append(agent)
        return agent

    try:
        yield start
    finally:
        for agent in started:
            agent.kill()


@pytest.fixture
def node(share_root: Path) -> Iterator[Callable[[str, ShareGeometry], Spawned]]:
    """Starts a node process of its own (as an engine would) and waits until it listens."""
    started: list[Spawned] = []

    def start(name: str, geometry: ShareGeometry) -> Spawned:
        spawned = spawn_server(SharePaths(name, share_root), geometry)
        assert spawned is not None
        started.append(spawned)
        assert spawned.wait_ready(60.0)
        return spawned

    try:
        yield start
    finally:
        for spawned in started:
            spawned.process.kill()
            spawned.process.wait()
