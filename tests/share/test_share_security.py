"""Another local user gets nothing of a share (decision 0018): no file of the share is
ever one it made (the engine refuses, naming the share, or never uses it), it can
read no slab byte and write no file of a live share, nor reach its socket; a peer
that reaches the socket anyway is closed at once. The group option widens this to
the members of one group. Files and the socket are owner-only whatever the umask.

The other user is a forked child that drops to uid 65534 (``other_user.py``), in a
root that is world-writable and sticky, as ``/dev/shm`` is."""

from __future__ import annotations

import os
import socket
import stat
import struct
import threading
from pathlib import Path

import pytest
from other_user import NOBODY, as_other_user, outcome
from share_fixtures import host_share, open_host_directory, serve_in_thread
from share_fixtures import stop_thread as stop

from kvoffload.core.errors import ConfigError
from kvoffload.core.keys import ChunkKey
from kvoffload.core.private_files import FilePolicy
from kvoffload.share.client import ShareDirectory
from kvoffload.share.connection import connect
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.paths import SharePaths
from kvoffload.share.protocol import HELLO, Op, Role, frame
from kvoffload.share.server import ShareServer
from kvoffload.share.server_start import open_server
from kvoffload.share.slab_files import HEADER_BYTES, header, slab_id_of
from kvoffload.tiers.host_shared_slab import SharedSlab
from kvoffload.tiers.node_shares import NodeShare

GEOMETRY = ShareGeometry(num_slots=4, slot_bytes=4096)
KEY = ChunkKey(bytes(15) + b"\x07")


def serve(paths: SharePaths) -> tuple[ShareServer, threading.Thread]:
    return serve_in_thread(paths, GEOMETRY)


def settings(root: Path, name: str, **extra: object) -> NodeShare:
    config = {"host_share": name, "cpu_bytes": 4 * 4096, "host_share_root": str(root), **extra}
    return host_share(config, chunk_bytes=4096)


def test_a_per_user_directory_another_user_made_is_refused(open_root: Path) -> None:
    mine = open_root / f"kvoffload-u{os.geteuid()}"

    def squat() -> list[str]:
        os.mkdir(mine)
        os.chmod(mine, 0o777)  # "come in"
        return os.listdir(open_root)

    assert as_other_user(squat) == [mine.name]
    with pytest.raises(ConfigError) as refused:
        open_host_directory(settings(open_root, "sq"), wait_s=5.0)
    assert refused.value.field == "host_share_root"
    assert f"share 'sq': {mine}" in str(refused.value) and "uid 65534" in str(refused.value)
    assert os.listdir(mine) == []  # nothing of the share went there


def test_a_per_user_directory_that_is_a_link_is_refused(open_root: Path) -> None:
    mine = open_root / f"kvoffload-u{os.geteuid()}"

    def squat() -> None:
        os.mkdir(open_root / "bait", 0o777)
        os.symlink(open_root / "bait", mine)

    as_other_user(squat)
    with pytest.raises(ConfigError, match="'host_share_root'.*share 'ln'.*symbolic link"):
        SharePaths("ln", open_root).ensure_dir()
    assert os.listdir(open_root / "bait") == []


def test_a_root_others_may_replace_entries_of_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "open"
    root.mkdir()
    os.chmod(root, 0o777)  # writable by all, not sticky
    with pytest.raises(ConfigError, match="'host_share_root'.*not sticky"):
        SharePaths("x", root).ensure_dir()
    with pytest.raises(ConfigError, match="'host_share_root'.*socket path .* more than the 107"):
        SharePaths("x", tmp_path / ("d" * 100))


def test_files_planted_in_the_share_directory_are_never_used(open_root: Path) -> None:
    """Files someone else made (here: given to uid 65534 by root, since nobody else
    can enter the directory) are replaced, or refused; a link is never followed."""
    paths = SharePaths("planted", open_root)
    paths.ensure_dir()
    planted = GEOMETRY.with_slab_id(b"p" * 16)
    paths.slab(0).write_bytes(header(planted, 0) + bytes(4 * 4096))
    paths.meta.write_text('{"num_slots": 4, "slot_bytes": 4096, "policy": "lru"}')
    victim = open_root / "victim"
    victim.write_bytes(b"keep")
    os.symlink(victim, paths.index)
    for path in (paths.slab(0), paths.meta):
        os.chown(path, NOBODY, NOBODY)
        os.chmod(path, 0o666)
    server, thread = serve(paths)
    try:
        st = os.lstat(paths.slab(0))
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (os.geteuid(), 0o600)  # made anew
        assert slab_id_of(paths.slab(0).read_bytes()[:HEADER_BYTES]) not in (b"", b"p" * 16)
        assert os.lstat(paths.meta).st_uid == os.geteuid()
        assert stat.S_ISREG(os.lstat(paths.index).st_mode) and victim.read_bytes() == b"keep"
        assert server.geometry.generation == 1  # the planted meta was not believed
    finally:
        stop(server, thread)
    os.chown(paths.server_lock, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match="share 'planted'.*server.lock is owned by uid 65534"):
        open_server(paths, GEOMETRY)


def test_another_user_reads_and_writes_nothing_of_a_live_share(open_root: Path) -> None:
    paths = SharePaths("live", open_root)
    server, thread = serve(paths)
    try:
        client = ShareDirectory(paths, timeout_s=30.0, start_server=False)
        assert client.wait_ready(30.0)
        slab = SharedSlab(paths, server.geometry, 0, 4096, pin_memory=False)
        prepared = client.prepare_store([KEY])
        slab.slot_bytes(prepared.slots[0])[:] = b"\x07" * 4096
        client.complete_store(prepared.keys, success=True)

        def attempts() -> dict[str, str]:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            return {
                "list": outcome(lambda: os.listdir(paths.user_dir)),
                "read slab": outcome(lambda: paths.slab(0).read_bytes()),
                "write index": outcome(lambda: paths.index.open("r+b")),
                "make a file": outcome(lambda: (paths.user_dir / "x").write_bytes(b"")),
                "make a share": outcome(lambda: os.mkdir(paths.user_dir / "other")),
                "remove it": outcome(lambda: os.rename(paths.user_dir, open_root / "gone")),
                "connect": outcome(lambda: sock.connect(str(paths.socket))),
            }

        tried = as_other_user(attempts)
        assert set(tried.values()) == {"PermissionError"}, tried
        assert client.readable_prefix([KEY]) == 1  # the share is untouched
        slab.close()
        client.close()
    finally:
        stop(server, thread)


def test_a_peer_of_another_user_is_closed_at_once(
    open_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Even with the directories opened up (a mistake), the node process believes no
    connection of another user: SO_PEERCRED, checked at accept."""
    paths = SharePaths("peer", open_root)
    server, thread = serve(paths)
    try:
        for path in (paths.user_dir, paths.dir, paths.socket):
            os.chmod(path, 0o777)

        def hello() -> str:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(30.0)
                sock.connect(str(paths.socket))  # allowed by the file system here
                try:
                    sock.sendall(frame(Op.HELLO, HELLO.pack(bytes(16), Role.DIRECTORY, 0)))
                    return "closed" if sock.recv(64) == b"" else "answered"
                except (BrokenPipeError, ConnectionResetError):
                    return "closed"

        assert as_other_user(hello) == "closed"
        assert server.refused == 1
    finally:
        stop(server, thread)
    assert "refused a connection of pid" in capsys.readouterr().err


def test_a_group_named_in_the_config_is_trusted_like_the_owner(open_root: Path) -> None:
    groups = os.getgroups()
    os.setgroups([*groups, NOBODY])  # this process (the node process) is a member
    try:
        paths = SharePaths("grp", open_root, group=NOBODY)
        server, thread = serve(paths)
        try:
            client = ShareDirectory(paths, timeout_s=30.0, start_server=False)
            assert client.wait_ready(30.0)
            prepared = client.prepare_store([KEY])
            slab = SharedSlab(paths, server.geometry, 0, 4096, pin_memory=False)
            slab.slot_bytes(prepared.slots[0])[:] = b"\x07" * 4096
            client.complete_store(prepared.keys, success=True)
            st = os.stat(paths.user_dir)
            assert (stat.S_IMODE(st.st_mode), st.st_gid) == (0o2770, NOBODY)
            assert {stat.S_IMODE(os.lstat(p).st_mode) for p in paths.dir.iterdir()} == {0o660}

            def member() -> list[object]:
                member_paths = SharePaths("grp", open_root, group=NOBODY)
                opened = connect(member_paths, bytes(16), Role.LEASE, b"", 30.0)
                first = member_paths.slab(0).read_bytes()[HEADER_BYTES + 4096 * prepared.slots[0]]
                return [opened is not None, first]

            assert as_other_user(member) == [True, 7]  # uid 65534, of group 65534
            stranger = as_other_user(lambda: outcome(lambda: os.listdir(paths.dir)), gid=12345)
            assert stranger == "PermissionError"
            slab.close()
            client.close()
        finally:
            stop(server, thread)
    finally:
        os.setgroups(groups)
    with pytest.raises(ConfigError, match="'host_share_group'"):
        settings(open_root, "g", host_share_group="no-such-group-kvoffload")


def test_files_and_socket_are_owner_only_under_a_permissive_umask(open_root: Path) -> None:
    old = os.umask(0o002)
    try:
        paths = SharePaths("umask", open_root)
        server, thread = serve(paths)
        stop(server, thread)
        server = open_server(paths, None)  # a second start: every file exists already
        try:
            modes = {p.name: stat.S_IMODE(os.lstat(p).st_mode) for p in paths.dir.iterdir()}
            assert modes["sock"] == 0o600 and set(modes.values()) == {0o600}, modes
            assert stat.S_IMODE(os.stat(paths.dir).st_mode) == 0o700
            assert stat.S_IMODE(os.stat(paths.user_dir).st_mode) == 0o700
            assert struct.unpack("<I", paths.server_lock.read_bytes())[0] == os.getpid()
        finally:
            server.close()
    finally:
        os.umask(old)
    st = os.stat(paths.dir)
    assert FilePolicy("umask").problem(st) is None
