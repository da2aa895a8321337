"""Real vLLM engines in separate processes sharing one disk tier (decision 0017): below
a ``host_share``, or below each engine's own host tier (``disk_share: node``); tiny
Llama, float32, greedy.

Host memory is small (10 chunks) and the disk large, so what one engine computed
reaches another engine from the shared disk once host memory has evicted it.
Each engine runs in a child process (:class:`share_support.Child`); the test waits
on its answers and on process exits, never on time, except for the bounded wait for
a new node process to recover the disk's chunks (it does that on its own). Every
child and both node processes are stopped by pid at the end, on failure too.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from llm_support import CHUNK_BYTES, PROMPTS
from share_support import Child, counts, share_config, stop_node_process

from kvoffload.share.client import ShareDirectory
from kvoffload.share.launch import server_alive
from kvoffload.share.paths import SharePaths
from kvoffload.testing.share_process import stop_node_process as stop_by_name
from kvoffload.tiers.disk import FORMAT_DIR, slot_bytes
from kvoffload.tiers.disk_backing import DiskBacking

HOST_CHUNKS = 10  # less than two prompts: the earlier prompts leave host memory
DISK_CHUNKS = 64  # every prompt used here


@pytest.fixture(params=["host-share", "private-hosts"])
def shared(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """A disk tier shared by the engines under a private root: below a host share
    (``disk_share`` auto), or below each engine's own host tier (``disk_share:
    node``). The share root is short (a Unix socket's path holds at most 107 bytes);
    every node process is stopped by pid at the end."""
    root = Path(tempfile.mkdtemp(prefix="kvd-", dir="/tmp"))
    extra = share_config(root, f"disk-{os.getpid()}", HOST_CHUNKS * CHUNK_BYTES)
    if request.param == "private-hosts":
        del extra["host_share"]
        extra["disk_share"] = "node"
    extra["disk_path"] = str(tmp_path / "disk")
    extra["disk_bytes"] = DISK_CHUNKS * slot_bytes(CHUNK_BYTES)
    try:
        yield extra
    finally:
        try:
            paths = disk_share(extra)
        except AssertionError:
            paths = None  # no engine got as far as the disk tier
        if paths is not None:
            assert stop_by_name(paths.name, paths.root, 30.0)
        if "host_share" in extra:
            stop_node_process(extra)
        shutil.rmtree(root, ignore_errors=True)


def disk_share(extra: dict[str, Any]) -> SharePaths:
    """The files of the disk share the engines use (one namespace: one model)."""
    (namespace,) = (Path(extra["disk_path"]) / FORMAT_DIR).iterdir()
    backing = DiskBacking(Path(extra["disk_path"]), bytes.fromhex(namespace.name))
    return backing.paths(Path(extra["host_share_root"]))


def disk_counts(paths: SharePaths, chunks: int | None = None) -> Any:
    """The disk share's counts, asked by a bare client; with ``chunks``, waited for
    (bounded) until it holds that many (a new node process recovers them on its own)."""
    client = ShareDirectory(paths, start_server=False, lease=False, timeout_s=5.0)
    try:
        assert client.wait_ready(30.0)
        deadline = time.monotonic() + 30.0
        found = client.share_counts()
        while chunks is not None and (found is None or found.chunks < chunks):
            assert time.monotonic() < deadline, f"{found} never held {chunks} chunks"
            time.sleep(0.05)
            found = client.share_counts()
        return found
    finally:
        client.close()


def node_pid(paths: SharePaths) -> int:
    return int.from_bytes(paths.server_lock.read_bytes()[:4], "little")


def test_engines_share_one_disk_tier_and_a_killed_node_process_recovers_it(
    tiny_model: Path, tmp_path: Path, shared: dict[str, Any], children: list[Child]
) -> None:
    prompts = PROMPTS[:4]
    reference = Child(tiny_model, None, tmp_path / "reference.log")
    children.append(reference)
    expected = reference.ask(prompts=prompts)["tokens"]
    assert reference.close() == 0

    a = Child(tiny_model, shared, tmp_path / "a.log")
    children.append(a)
    a.send(prompts=prompts[:3], stream=True)  # one at a time, each settled
    assert [a.read()["tokens"] for _ in range(3)] == [expected[i : i + 1] for i in range(3)]
    paths = disk_share(shared)
    assert disk_counts(paths).chunks == 3 * 8  # written through, once each

    b = Child(tiny_model, shared, tmp_path / "b.log")  # A still runs
    children.append(b)
    # A is SIGKILLed right after answering a new prompt, its copies in flight or not.
    a.send(prompts=prompts[3:], stream=True, settle=False)
    a.read()
    a.kill()
    first = b.ask(prompts=prompts[:1])
    assert first["tokens"] == expected[0:1]
    assert first["disk_hit_tokens"] == len(prompts[0]), first  # gone from host: all disk
    assert first["cached"] == [len(prompts[0])], first
    assert b.close() == 0
    left = disk_counts(paths)
    assert left.pinned == 0 and left.storing == 0  # the killed engine's bookings dropped
    assert left.chunks >= 3 * 8

    # The disk share's node process dies; the next engine starts a new one, which
    # recovers the chunks from the slabs (verified on every read).
    pid = node_pid(paths)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30.0
    while server_alive(paths):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    c = Child(tiny_model, shared, tmp_path / "c.log")
    children.append(c)
    recovered = disk_counts(paths, chunks=3 * 8)
    assert node_pid(paths) != pid and recovered.storing == 0
    again = c.ask(prompts=prompts[1:2])
    assert again["tokens"] == expected[1:2]
    assert again["disk_hit_tokens"] == len(prompts[1]), again  # warm: the recovered disk
    assert c.close() == 0
    if "host_share" in shared:
        host = counts(shared)
        assert host is not None and host.pinned == 0 and host.storing == 0
