"""The test support's redis-servers: every process started is stopped by its pid,
after restarts and on failure too, and none is left unnoticed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvoffload.testing.redis_server import RedisServer, live_servers, stop_leftovers


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_leaving_the_block_kills_the_restarted_process_on_failure_too(tmp_path: Path) -> None:
    pids = []
    with pytest.raises(KeyError), RedisServer(tmp_path) as server:
        server.start()
        assert server.proc is not None
        pids.append(server.proc.pid)
        server.restart()
        pids.append(server.proc.pid)
        assert live_servers() == [server] and server.client().ping()
        raise KeyError("a failing test")
    assert pids[0] != pids[1] and all(gone(pid) for pid in pids)
    assert live_servers() == [] and server.proc is None


def test_a_running_server_is_not_started_twice(tmp_path: Path) -> None:
    with RedisServer(tmp_path).start() as server:
        with pytest.raises(RuntimeError, match="running already"):
            server.start()
        assert live_servers() == [server]


def test_leftovers_are_stopped_and_named(tmp_path: Path) -> None:
    server = RedisServer(tmp_path).start()  # a test that forgets to stop it
    assert server.proc is not None
    pid = server.proc.pid
    (left,) = stop_leftovers()
    assert left == f"pid {pid} port {server.port} in {tmp_path}"
    assert gone(pid) and live_servers() == [] and stop_leftovers() == []
