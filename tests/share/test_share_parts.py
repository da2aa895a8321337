"""The share's parts on their own: geometry and meta file, slab files and mapping,
node-process start-up (one per share, generations), the ``kvoffload share`` command."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvoffload.cli import main as cli_main
from kvoffload.core.errors import ConfigError, ContractViolation
from kvoffload.share.launch import server_alive, spawn_server
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.paths import SharePaths
from kvoffload.share.serve import main as share_main
from kvoffload.share.server_start import AlreadyServing, open_server
from kvoffload.share.slab_files import HEADER_BYTES
from kvoffload.tiers.host_shared_slab import SharedSlab


def test_geometry_from_a_budget_and_its_meta_file(tmp_path: Path) -> None:
    g = ShareGeometry.for_budget(1 << 20, 4096, ranks=2, policy="arc").with_slab_id(b"i" * 16)
    assert (g.num_slots, g.slot_bytes, g.ranks, g.policy) == (128, 4096, 2, "arc")
    paths = SharePaths("meta", tmp_path)
    assert ShareGeometry.read(paths) is None
    paths.ensure_dir()
    g.write(paths)
    assert ShareGeometry.read(paths) == g
    with pytest.raises(ConfigError, match="cpu_bytes"):
        ShareGeometry.for_budget(4095, 4096)
    with pytest.raises(ConfigError, match="host_share"):
        SharePaths("no/slash")


def test_an_engine_with_other_chunks_is_refused_at_start_up() -> None:
    g = ShareGeometry(num_slots=4, slot_bytes=4096, ranks=2)
    g.check_fits(4096, 1)
    with pytest.raises(ConfigError, match="4096 B per rank, this engine's are 8192 B"):
        g.check_fits(8192, 0)
    with pytest.raises(ConfigError, match="rank 2"):
        g.check_fits(4096, 2)


def test_one_node_process_per_share_and_each_restart_a_new_generation(
    share_root: Path,
) -> None:
    paths = SharePaths("gen", share_root)
    with pytest.raises(ConfigError, match="does not exist"):
        open_server(paths, None)
    first = open_server(paths, ShareGeometry(num_slots=4, slot_bytes=4096, ranks=2))
    assert server_alive(paths)
    with pytest.raises(AlreadyServing):
        open_server(paths, None)
    inodes = [os.stat(paths.slab(r)).st_ino for r in range(2)]
    assert [os.path.getsize(paths.slab(r)) for r in range(2)] == [HEADER_BYTES + 4 * 4096] * 2
    first.close()
    assert not server_alive(paths) and not paths.socket.exists()
    second = open_server(paths, ShareGeometry(num_slots=99, slot_bytes=64))  # the meta wins
    try:
        assert second.geometry.generation == 2 and second.geometry.num_slots == 4
        assert [os.stat(paths.slab(r)).st_ino for r in range(2)] == inodes  # kept, mapped
        assert len(second.book.directory) == 0
    finally:
        second.close()


def test_the_slab_is_one_mapping_per_rank_shared_between_processes(share_root: Path) -> None:
    paths = SharePaths("slab", share_root)
    server = open_server(paths, ShareGeometry(num_slots=4, slot_bytes=256, ranks=2))
    try:
        g = server.geometry
        with pytest.raises(ConfigError, match="256 B per rank"):
            SharedSlab(paths, g, 0, 512, pin_memory=False)
        one, other = (SharedSlab(paths, g, 1, 256, pin_memory=False) for _ in range(2))
        assert (one.num_slots, one.chunk_bytes, one.nbytes, one.pinned) == (4, 256, 1024, False)
        one.slot_tensor(2)[:] = 7
        assert bytes(other.slot_bytes(2)) == bytes([7]) * 256  # the same memory
        assert other.view(torch.float32).shape == (4, 64)
        assert other.data.shape == (4, 256)
        rank0 = SharedSlab(paths, g, 0, 256, pin_memory=False)
        assert bytes(rank0.slot_bytes(2)) != bytes([7]) * 256  # another rank's file
        with pytest.raises(ContractViolation):
            one.slot_bytes(4)
        with open(paths.slab(1), "rb") as f:
            f.seek(HEADER_BYTES + 2 * 256)
            assert f.read(256) == bytes([7]) * 256
    finally:
        server.close()


def test_the_share_command(share_root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = ["--root", str(share_root)]
    assert share_main(["stop", "cmd", *root]) == 0  # nothing to stop
    assert cli_main(["share", "serve", "cmd", *root]) == 2  # a new share needs a size
    assert "does not exist: give its size" in capsys.readouterr().err
    paths = SharePaths("cmd", share_root)
    server = open_server(paths, ShareGeometry(num_slots=2, slot_bytes=64))
    try:
        assert cli_main(["share", "remove", "cmd", *root]) == 1
        assert "its node process runs" in capsys.readouterr().err
    finally:
        server.close()
    assert share_main(["remove", "cmd", *root]) == 0
    assert not paths.dir.exists() and paths.user_dir.exists()


def test_a_node_process_stops_on_the_stop_command(share_root: Path) -> None:
    paths = SharePaths("stop", share_root)
    spawned = spawn_server(paths, ShareGeometry(num_slots=2, slot_bytes=64))
    assert spawned is not None
    try:
        assert spawned.wait_ready(60.0) and server_alive(paths)
        assert share_main(["stop", "stop", "--root", str(share_root)]) == 0
        assert spawned.process.wait(60.0) == 0
        assert not server_alive(paths) and not paths.socket.exists()
        assert paths.meta.exists() and paths.slab(0).exists()  # the share stays
    finally:
        spawned.process.kill()
        spawned.process.wait()
