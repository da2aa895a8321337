"""Private redis-servers for tests: free loopback ports, stopped by their pids.

``RedisServer.start()`` launches ``redis-server`` (no persistence, debug commands on
so tests can make it slow with ``DEBUG SLEEP``) and waits until it answers PING;
``kill()`` stops it by pid (SIGKILL: a crash), ``restart()`` starts it again on the
same port, empty. ``extra`` adds server arguments (``--requirepass``, TLS, cluster
mode); ``client_kwargs`` are what a client needs to reach it (TLS settings).
``start_cluster`` makes a three-master Redis Cluster of such servers.
``scripts/test`` installs redis-server when it is missing. Shipped as test support:
the vLLM fuzzer starts one too.

Whoever starts a server stops it: ``with RedisServer(...) as server:`` kills whatever
process the server runs when the block ends (after any number of restarts, on failure
too), as ``kill()`` does. Every running server is in one registry, this module's
(``live_servers``); ``stop_leftovers`` stops and names those still running (the test
suite calls it at the end of the session and fails when any was left).
"""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

from kvoffload.testing.ports import free_port

_live: dict[int, RedisServer] = {}  # pid -> the server running it; owned by this module


def free_cluster_port() -> int:
    """A free port P whose cluster bus port P + 10000 is free too (and below 65536)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 30000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 10000))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisServer:
    """One private redis-server, stopped by its pid (:meth:`kill`, or leaving the
    ``with`` block). Not thread-safe."""

    def __init__(
        self,
        workdir: Path,
        port: int | None = None,
        extra: Sequence[str] = (),
        client_kwargs: dict[str, Any] | None = None,
        scheme: str = "redis",
    ) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.extra = tuple(extra)
        self.client_kwargs = dict(client_kwargs or {})
        self.scheme = scheme
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Launch the server and wait until it answers. RuntimeError when it is
        running already, or does not answer within 10 s (it is killed then)."""
        if self.running:
            raise RuntimeError(f"redis-server on port {self.port} is running already")
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (./scripts/test installs it)")
        tls = "--tls-port" in self.extra
        port_args = (
            ["--port", "0", "--tls-port", str(self.port)] if tls else ["--port", str(self.port)]
        )
        extra = [a for a in self.extra if a != "--tls-port"]
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [
                binary,
                *port_args,
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--enable-debug-command",
                "yes",
                "--dir",
                str(self.workdir),
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _live[self.proc.pid] = self
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            raise
        return self

    def _wait_ready(self) -> None:
        proc = self.proc
        assert proc is not None
        client = self.client(socket_timeout=1)
        deadline = time.monotonic() + 10
        try:
            while True:
                try:
                    client.ping()
                    return
                except (redis.ConnectionError, redis.TimeoutError):
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise RuntimeError("redis-server did not start") from None
                    time.sleep(0.02)  # waiting for a process to listen, not for a transfer
        finally:
            client.close()

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """Stop the server's process by its pid (SIGKILL) and reap it; nothing when
        it is not running."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
            _live.pop(self.proc.pid, None)
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()

    def restart(self) -> None:
        self.kill()
        self.start()

    def client(self, socket_timeout: float = 5) -> redis.Redis:
        return redis.Redis(
            host="127.0.0.1", port=self.port, socket_timeout=socket_timeout, **self.client_kwargs
        )


def live_servers() -> list[RedisServer]:
    """The servers started here whose process is still running."""
    return [server for server in list(_live.values()) if server.running]


def stop_leftovers() -> list[str]:
    """Stop every server still running (by pid) and say which they were: pid, port
    and working directory (a test's temporary directory names the test)."""
    left = live_servers()
    named = [f"pid {s.proc.pid if s.proc else '?'} port {s.port} in {s.workdir}" for s in left]
    for server in left:
        server.kill()
    _live.clear()
    return named


def start_cluster(workdir: Path, masters: int = 3) -> list[RedisServer]:
    """``masters`` cluster-mode servers joined into one cluster covering every slot."""
    servers = []
    try:
        for i in range(masters):
            port = free_cluster_port()
            servers.append(
                RedisServer(
                    workdir / f"node{i}",
                    port,
                    extra=(
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        f"nodes-{port}.conf",
                    ),
                ).start()
            )
        slots = 16384
        for i, server in enumerate(servers):
            low, high = i * slots // masters, (i + 1) * slots // masters
            server.client().execute_command("CLUSTER ADDSLOTSRANGE", low, high - 1)  # type: ignore[no-untyped-call]
        for server in servers[1:]:
            servers[0].client().execute_command("CLUSTER MEET", "127.0.0.1", server.port)  # type: ignore[no-untyped-call]
        deadline = time.monotonic() + 20
        while not all(_converged(s, masters) for s in servers):
            if time.monotonic() > deadline:
                raise RuntimeError("the test cluster did not converge")
            time.sleep(0.05)  # waiting for gossip between processes, not for a transfer
        return servers
    except BaseException:
        for server in servers:
            server.kill()
        raise


def _converged(server: RedisServer, masters: int) -> bool:
    info = server.client().cluster("info")
    return bool(
        info.get("cluster_state") == "ok" and int(info.get("cluster_known_nodes", 0)) == masters
    )
