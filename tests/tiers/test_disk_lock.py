"""One engine per disk tier namespace: the lock a second engine is refused by, released
on close and by the kernel when the holder dies, ignored by inspection."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kvoffload.core.errors import ConfigError
from kvoffload.core.keys import ChunkKey
from kvoffload.inspection.disk_scan import inspect_disk
from kvoffload.tiers.disk import DiskStore
from kvoffload.tiers.disk_lock import DiskLock, Holder, check_workers_engine, lock_path

DIGEST = bytes(range(16))
OTHER = bytes(range(1, 17))
PAYLOAD = 8192


@contextmanager
def held_by_another_process(root: Path, digest: bytes = DIGEST) -> Iterator[subprocess.Popen[str]]:
    """A child process holding the namespace's lock until it is killed (by its pid,
    on failure too)."""
    code = (
        "import sys; from pathlib import Path; from kvoffload.tiers.disk_lock import DiskLock; "
        f"lock = DiskLock.acquire(Path({str(root)!r}), bytes.fromhex({digest.hex()!r})); "
        "print('held', flush=True); sys.stdin.read()"
    )
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "PYTHONPATH": src}
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=env,
    )  # fmt: skip
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == "held\n"
        yield child
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()


def test_a_second_engine_is_refused_in_one_line_naming_disk_path_and_the_holder(
    tmp_path: Path,
) -> None:
    first = DiskLock.acquire(tmp_path, DIGEST)
    try:
        with pytest.raises(ConfigError) as refused:
            DiskLock.acquire(tmp_path, DIGEST)  # another open file: refused in one process too
        message = str(refused.value)
        assert refused.value.field == "disk_path" and "\n" not in message
        assert f"{tmp_path} is in use by another engine (pid {os.getpid()} on host " in message
        assert f"host {socket.gethostname()} since {first.holder.since})" in message
        assert "give each engine its own disk_path" in message
        assert first.held
    finally:
        first.release()


def test_released_on_close_and_release_is_idempotent(tmp_path: Path) -> None:
    first = DiskLock.acquire(tmp_path, DIGEST)
    first.release()
    first.release()
    assert not first.held
    second = DiskLock.acquire(tmp_path, DIGEST)
    second.release()
    assert lock_path(tmp_path, DIGEST).exists()  # never deleted
    assert oct(lock_path(tmp_path, DIGEST).stat().st_mode & 0o777) == "0o600"


def test_a_crashed_engines_lock_file_does_not_block_a_restart(tmp_path: Path) -> None:
    path = lock_path(tmp_path, DIGEST)
    path.parent.mkdir(parents=True)
    path.write_bytes(Holder(999_999, "gone", "2026-01-01T00:00:00Z").encode())
    path.chmod(0o600)  # as kvoffload makes it
    lock = DiskLock.acquire(tmp_path, DIGEST)
    try:
        assert json.loads(path.read_text())["pid"] == os.getpid()  # the new holder recorded
    finally:
        lock.release()


def test_the_kernel_releases_a_killed_holders_lock(tmp_path: Path) -> None:
    with (
        held_by_another_process(tmp_path) as child,
        pytest.raises(ConfigError, match=f"pid {child.pid} on host"),
    ):
        DiskLock.acquire(tmp_path, DIGEST)
    DiskLock.acquire(tmp_path, DIGEST).release()  # the holder was killed: free again


def test_engines_of_different_models_use_different_namespaces(tmp_path: Path) -> None:
    first = DiskLock.acquire(tmp_path, DIGEST)
    second = DiskLock.acquire(tmp_path, OTHER)
    first.release()
    second.release()


def test_an_unrecorded_holder_is_said_so(tmp_path: Path) -> None:
    first = DiskLock.acquire(tmp_path, DIGEST)
    try:
        lock_path(tmp_path, DIGEST).write_bytes(b"")
        with pytest.raises(ConfigError, match=r"another engine \(holder not recorded\)"):
            DiskLock.acquire(tmp_path, DIGEST)
    finally:
        first.release()


def test_workers_accept_their_own_engine_and_refuse_another(tmp_path: Path) -> None:
    check_workers_engine(tmp_path, DIGEST)  # no lock file yet: nothing created
    assert not lock_path(tmp_path, DIGEST).parent.exists()
    own = DiskLock.acquire(tmp_path, DIGEST)  # this process's engine (in process)
    check_workers_engine(tmp_path, DIGEST)
    own.release()
    check_workers_engine(tmp_path, DIGEST)  # a lock file nobody holds
    DiskLock.acquire(tmp_path, DIGEST).release()  # the check left no lock behind
    with held_by_another_process(tmp_path) as child:
        with pytest.raises(ConfigError, match=f"in use by another engine \\(pid {child.pid} "):
            check_workers_engine(tmp_path, DIGEST)
        check_workers_engine(tmp_path, OTHER)


def test_inspect_reads_a_locked_tier_and_ignores_the_lock_file(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, DIGEST, 0, PAYLOAD, 4)
    store.write(1, ChunkKey(bytes(16)), memoryview(bytes(PAYLOAD)))
    lock = DiskLock.acquire(tmp_path, DIGEST)
    try:
        report = inspect_disk(tmp_path, None, verify=True, world_size=None)
        assert report.stray == 0
        (namespace,) = report.namespaces
        assert (namespace.complete_chunks, namespace.ok, namespace.bad_slabs) == (1, 1, [])
        assert lock.held  # inspection took no lock and left the holder's alone
        with pytest.raises(ConfigError):
            DiskLock.acquire(tmp_path, DIGEST)
    finally:
        lock.release()
        store.close()
