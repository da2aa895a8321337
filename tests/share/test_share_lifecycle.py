"""What ``kvoffload share stop`` and ``remove`` verify before they signal or delete
(decision 0018), space reserved when a share is made, and a node process that does
not answer at start, named with its pid. Every process a test starts is stopped
by pid at the end."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from share_fixtures import host_share, open_host_directory

from kvoffload.core.errors import ConfigError
from kvoffload.core.private_files import open_or_create
from kvoffload.share.client import ShareDirectory
from kvoffload.share.launch import Spawned, server_alive
from kvoffload.share.lifecycle import remove_share, stop_share
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.paths import SharePaths
from kvoffload.share.slab_files import allocate
from kvoffload.tiers.node_shares import NodeShare, serve_share

GEOMETRY = ShareGeometry(num_slots=4, slot_bytes=4096)
NodeFactory = Callable[[str, ShareGeometry], Spawned]


@pytest.fixture
def bystander() -> Iterator[subprocess.Popen[bytes]]:
    """A process of this user that is not a node process: it must never be signalled."""
    process = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                               stdin=subprocess.PIPE)  # fmt: skip
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def test_stop_signals_nothing_it_cannot_verify(
    share_root: Path, node: NodeFactory, bystander: subprocess.Popen[bytes]
) -> None:
    paths = SharePaths("verify", share_root)
    assert stop_share(paths) == (0, f"share 'verify' is not running (in {paths.dir})")
    spawned = node("verify", GEOMETRY)
    lock = open_or_create(paths.server_lock, os.O_RDWR, paths.policy)
    try:
        os.pwrite(lock, bystander.pid.to_bytes(4, "little"), 0)  # names another process
    finally:
        os.close(lock)
    code, line = stop_share(paths)
    assert code == 1 and "nothing signalled" in line and f"names pid {bystander.pid}" in line
    assert bystander.poll() is None and spawned.process.poll() is None and server_alive(paths)


def test_stop_signals_nothing_when_a_lock_holder_does_not_answer(
    share_root: Path, bystander: subprocess.Popen[bytes]
) -> None:
    """A held server lock naming some process, and no node process behind the socket:
    stop refuses (a process it cannot verify is never signalled)."""
    paths = SharePaths("squat", share_root)
    paths.ensure_dir()
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
         "os.pwrite(fd, int(sys.argv[2]).to_bytes(4, 'little'), 0); "
         "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()",
         str(paths.server_lock), str(bystander.pid)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        os.close(open_or_create(paths.server_lock, os.O_RDWR, paths.policy))
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        code, line = stop_share(paths)
        assert code == 1 and "does not answer" in line and "nothing signalled" in line
        assert bystander.poll() is None and holder.poll() is None
        with pytest.raises(ConfigError) as refused:  # an engine is told who and what to do
            serve_share(_share(share_root, "squat"), wait_s=0.5)
        message = str(refused.value)
        assert refused.value.field == "host_share" and "'squat'" in message
        assert f"(pid {bystander.pid}) does not answer" in message
        assert "kvoffload share stop squat" in message
    finally:
        holder.kill()
        holder.wait()


def test_remove_deletes_exactly_one_share_and_stop_stops_the_other(
    share_root: Path, node: NodeFactory
) -> None:
    """Share ``a1`` and share ``a1.b``: removing one leaves the other whole and
    serving, and the other then stops (the bug of issue 30: a glob over ``a1.*``)."""
    first, second = node("a1", GEOMETRY), node("a1.b", GEOMETRY)
    one, other = SharePaths("a1", share_root), SharePaths("a1.b", share_root)
    before = sorted(os.listdir(other.dir))
    assert stop_share(one) == (0, f"stopped share 'a1' (node process pid {first.process.pid})")
    assert first.process.wait(10.0) == 0  # stop waited until it exited
    code, line = remove_share(one)
    assert code == 0 and line.startswith("removed share 'a1'"), line
    assert not one.dir.exists() and sorted(os.listdir(other.dir)) == before
    assert server_alive(other) and second.process.poll() is None
    code, _ = stop_share(other)
    assert code == 0 and second.process.wait(10.0) == 0


def test_remove_refuses_while_the_node_process_or_an_engine_is_attached(
    share_root: Path, node: NodeFactory
) -> None:
    spawned = node("busy", GEOMETRY)
    paths = SharePaths("busy", share_root)
    code, line = remove_share(paths)
    assert code == 1 and f"its node process runs (pid {spawned.process.pid})" in line
    engine = ShareDirectory(paths, timeout_s=30.0, start_server=False)
    try:
        assert engine.wait_ready(30.0)
        assert stop_share(paths)[0] == 0
        files = sorted(os.listdir(paths.dir))
        code, line = remove_share(paths)
        assert code == 1 and "engines are attached" in line and "nothing removed" in line
        assert sorted(os.listdir(paths.dir)) == files
    finally:
        engine.close()
    (paths.dir / "notes.txt").write_text("not kvoffload's")
    code, line = remove_share(paths)
    assert code == 1 and "notes.txt" in line and "stays" in line
    assert os.listdir(paths.dir) == ["notes.txt"]  # every file it knows is gone


@contextlib.contextmanager
def small_root() -> Iterator[Path]:
    """An 8 MiB tmpfs (Docker's /dev/shm is 64 MB), unmounted at the end."""
    where = Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(where)],
                       check=True, capture_output=True)  # fmt: skip
    except (OSError, subprocess.CalledProcessError) as exc:
        os.rmdir(where)
        pytest.fail(f"cannot mount a tmpfs here (the tests run as root): {exc}")
    try:
        yield where
    finally:
        subprocess.run(
            ["umount", "--lazy", str(where)], check=False
        )  # a node process may be exiting
        os.rmdir(where)


def _share(root: Path, name: str, cpu_bytes: int = 4 * 4096, chunk: int = 4096) -> NodeShare:
    config = {"host_share": name, "cpu_bytes": cpu_bytes, "host_share_root": str(root)}
    return host_share(config, chunk_bytes=chunk)


def test_a_share_larger_than_its_root_is_refused_with_the_sizes() -> None:
    with small_root() as root:
        settings = _share(root, "big", cpu_bytes=32 << 20, chunk=64 << 10)
        with pytest.raises(ConfigError) as refused:
            open_host_directory(settings, wait_s=30.0)
        message = str(refused.value)
        assert refused.value.field == "host_share_root", message
        assert f"share 'big': {root} has" in message
        assert "bytes free, 33558528 bytes asked for its slabs" in message  # 4 KiB header
        assert "cannot serve" in settings.paths.log.read_text()  # said before readiness
        assert not server_alive(settings.paths)
        paths = SharePaths("fill", root)
        paths.ensure_dir()
        fd = os.open(paths.dir / "f", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            with pytest.raises(ConfigError, match="'host_share_root'.*No space left"):
                allocate(paths, fd, 16 << 20)  # past statvfs: posix_fallocate says ENOSPC
        finally:
            os.close(fd)


HUNG = """
import fcntl, os, socket, sys
lock = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(lock, fcntl.LOCK_EX)
os.pwrite(lock, os.getpid().to_bytes(4, "little"), 0)
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(sys.argv[2])
listener.listen(8)
print("listening", flush=True)
sys.stdin.read()
"""


def test_a_node_process_that_hangs_is_named_with_its_pid(share_root: Path) -> None:
    """A node process that holds the share and listens but never answers (hung): an
    engine's start fails naming the share, its pid, what it logged, what to do."""
    settings = _share(share_root, "hang")
    paths = settings.paths
    paths.ensure_dir()
    os.close(open_or_create(paths.server_lock, os.O_RDWR, paths.policy))
    hung = subprocess.Popen(
        [sys.executable, "-c", HUNG, str(paths.server_lock), str(paths.socket)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert hung.stdout is not None and hung.stdout.readline().strip() == "listening"
        with pytest.raises(ConfigError) as refused:
            open_host_directory(settings, wait_s=0.5)
        message = str(refused.value)
        assert refused.value.field == "host_share" and "share 'hang'" in message
        assert f"its node process (pid {hung.pid}) does not answer" in message
        assert "it last logged: no log" in message and "kvoffload share stop hang" in message
    finally:
        hung.kill()
        hung.wait()
