"""A slab's identity is part of the share's generation (decision 0018): the slab id
in every rank's header, the meta file and the WELCOME; kept with the files, new when
they are made anew. A worker maps the new files in place (every view stays valid)
only when nothing of it is in flight on the old ones, and runs a plan's host jobs
only on the slab the plan names; a scheduler half never books into a plan slots of
another slab than the plan's; a node process whose files are gone stops serving."""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest
from share_fixtures import host_share, serve_in_thread
from share_fixtures import stop_thread as stop

from kvoffload.core.errors import ContractViolation
from kvoffload.core.keys import ChunkKey
from kvoffload.share.client import ShareDirectory
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.paths import SharePaths
from kvoffload.share.queries import ShareUnavailable
from kvoffload.share.server import ShareServer
from kvoffload.share.server_start import open_server
from kvoffload.share.slab_files import HEADER_BYTES, slab_id_of
from kvoffload.testing.share_process import stop_node_process
from kvoffload.tiers.host_shared import SharedHostSlab
from kvoffload.tiers.host_shared_slab import SharedSlab

GEOMETRY = ShareGeometry(num_slots=4, slot_bytes=4096, ranks=2)


def K(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def header_id(paths: SharePaths, rank: int) -> bytes:
    with open(paths.slab(rank), "rb") as f:
        return slab_id_of(f.read(HEADER_BYTES))


def serve(
    paths: SharePaths, geometry: ShareGeometry = GEOMETRY
) -> tuple[ShareServer, threading.Thread]:
    return serve_in_thread(paths, geometry)


def wipe(paths: SharePaths) -> None:
    """Delete the share root's per-user directory wholesale (what systemd's RemoveIPC
    does); again while an engine's lease thread, reconnecting, made its users.lock
    anew in it meanwhile (it may under RemoveIPC too)."""
    for _ in range(100):
        shutil.rmtree(paths.user_dir, ignore_errors=True)
        if not paths.user_dir.exists():
            return
    raise AssertionError(f"{paths.user_dir} could not be deleted")


def test_the_slab_id_is_kept_with_the_files_and_new_when_they_are_made_anew(
    share_root: Path,
) -> None:
    paths = SharePaths("ids", share_root)
    first = open_server(paths, GEOMETRY)
    slab_id = first.geometry.slab_id
    assert len(slab_id) == 16 and header_id(paths, 0) == header_id(paths, 1) == slab_id
    recorded = ShareGeometry.read(paths)
    assert recorded is not None and recorded.slab_id == slab_id
    first.close()
    again = open_server(paths, None)  # the files kept: their id too
    assert again.geometry.slab_id == slab_id and again.geometry.generation == 2
    again.close()
    paths.slab(1).unlink()  # one rank's file gone: every rank's made anew, a new id
    third = open_server(paths, None)
    try:
        assert third.geometry.slab_id not in (b"", slab_id)
        assert header_id(paths, 0) == header_id(paths, 1) == third.geometry.slab_id
    finally:
        third.close()


def test_a_slab_is_remapped_in_place_to_the_shares_new_files(share_root: Path) -> None:
    paths = SharePaths("remap", share_root)
    server, thread = serve(paths)
    old_id = server.geometry.slab_id
    slab = SharedSlab(paths, server.geometry, 1, 4096, pin_memory=False)
    view = slab.slot_tensor(2)  # a view the copy paths hold on to
    view[:] = 5
    stop(server, thread)
    wipe(paths)
    server, thread = serve(paths)
    try:
        new_id = server.geometry.slab_id
        assert new_id != old_id and slab.slab_id == old_id
        assert slab.file_slab_id() == new_id
        assert not slab.remap(old_id)  # not what the file there holds: nothing changes
        assert int(view[0]) == 5
        assert slab.remap(new_id) and slab.slab_id == new_id
        assert int(view.sum()) == 0  # the same view, now the new file's (zeroed) slot
        view[:] = 9
        other = SharedSlab(paths, server.geometry, 1, 4096, pin_memory=False)
        assert bytes(other.slot_bytes(2)) == bytes([9]) * 4096  # one memory again
        other.close()
    finally:
        slab.close()
        stop(server, thread)


def test_a_worker_runs_a_plans_host_jobs_only_on_the_slab_it_names(share_root: Path) -> None:
    config = {"host_share": "w", "cpu_bytes": 4 * 4096, "host_share_root": str(share_root)}
    share = host_share(config, chunk_bytes=4096)
    worker = SharedHostSlab(share, chunk_bytes=4096, rank=0)
    try:
        own = worker.slab_id
        assert worker.admit(own, busy=lambda: True) is None
        assert "names no slab" in str(worker.admit(None, busy=lambda: False))
        assert stop_node_process("w", share_root)
        wipe(share.paths)
        starter = SharedHostSlab(share, chunk_bytes=4096, rank=0)  # new files
        new = starter.slab_id
        starter.close()
        assert new != own and worker.file_slab_id() == new
        assert "not the share's file" in str(worker.admit(os.urandom(16), busy=lambda: False))
        assert "still in flight" in str(worker.admit(new, busy=lambda: True))
        assert worker.remaps == 0 and worker.slab_id == own
        assert worker.admit(new, busy=lambda: False) is None
        assert worker.remaps == 1 and worker.slab_id == new
        assert share.paths.users_lock.exists()  # held again, in the new directory
    finally:
        worker.close()
        assert stop_node_process("w", share_root)


def test_bookings_of_another_slab_than_the_plans_are_undone(share_root: Path) -> None:
    """A scheduler half's plan names one slab: a booking answered by a node process
    of another slab (here: one that made the share's files anew) is undone at once,
    until the next plan names that slab."""
    paths = SharePaths("plans", share_root)
    server, thread = serve(paths)
    engine = ShareDirectory(
        paths, geometry=GEOMETRY, timeout_s=30.0, retry_s=0.0, start_server=False,
        bind_plans=True,
    )  # fmt: skip
    try:
        assert engine.wait_ready(30.0)
        old_id = server.geometry.slab_id
        stored = engine.prepare_store([K(1)])
        engine.complete_store(stored.keys, success=True)
        assert engine.seal_plan() == old_id
        stop(server, thread)
        wipe(paths)
        server, thread = serve(paths)
        assert engine.prepare_store([K(2)]).no_room  # the old node process: gone
        refused = engine.prepare_store([K(2)])  # answered in the new slab: undone
        assert refused.no_room and engine.storing_count == 0
        other = ShareDirectory(paths, timeout_s=30.0, start_server=False)
        assert other.wait_ready(30.0)
        present = other.prepare_store([K(3)])  # a chunk of the new slab
        other.complete_store(present.keys, success=True)
        other.close()
        with pytest.raises(ShareUnavailable):
            engine.slots_of([K(3)])
        with pytest.raises(ShareUnavailable):
            engine.prepare_load([K(3)])  # pinned there, and unpinned at once
        counts = engine.share_counts()
        assert counts is not None and (counts.storing, counts.pinned) == (0, 0)
        assert engine.seal_plan() == old_id  # the plan built meanwhile: of the old slab
        new = engine.prepare_store([K(2)])  # the next plan's: the new slab
        assert new.keys == (K(2),)
        engine.complete_store(new.keys, success=True)
        assert engine.seal_plan() == server.geometry.slab_id
        assert engine.readable_prefix([K(2)]) == 1  # from the new index
    finally:
        engine.close()
        stop(server, thread)


def test_a_stale_pin_never_yields_a_slot(share_root: Path) -> None:
    """A chunk pinned under a node process since gone with its files (no generation
    fence survives that): the one attached now may hold the same key, stored again
    by another engine, in a slot this engine never pinned, so ``slot_of`` and
    ``slots_of`` answer it as not present (a spill queue then drops it)."""
    paths = SharePaths("stale", share_root)
    server, thread = serve(paths)
    engine = ShareDirectory(paths, timeout_s=30.0, retry_s=0.0, start_server=False)
    try:
        assert engine.wait_ready(30.0)
        stored = engine.prepare_store([K(1)])
        engine.complete_store(stored.keys, success=True)
        engine.prepare_load([K(1)])  # a spill queue's pin, say
        stop(server, thread)
        wipe(paths)
        server, thread = serve(paths)
        other = ShareDirectory(paths, timeout_s=30.0, start_server=False)
        assert other.wait_ready(30.0)
        again = other.prepare_store([K(1)])  # stored again by another engine
        other.complete_store(again.keys, success=True)
        other.close()
        engine.lookup([K(9)])  # finds the old node process gone
        assert engine.wait_ready(30.0) and engine.lookup([K(1)]).readable_prefix == 1
        assert engine.slot_of(K(1)) is None
        with pytest.raises(ContractViolation):
            engine.slots_of([K(1)])
        engine.complete_load([K(1)])  # settled here: the stale pin
        assert engine.pinned_count == 0
    finally:
        engine.close()
        stop(server, thread)


def test_a_node_process_whose_files_are_gone_stops_serving(
    share_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = SharePaths("gone", share_root)
    server, thread = serve(paths, ShareGeometry(num_slots=4, slot_bytes=4096))
    engine = ShareDirectory(paths, timeout_s=30.0, start_server=False)
    try:
        assert engine.wait_ready(30.0) and server.check_own()
        wipe(paths)
        assert engine.prepare_store([K(1)]).no_room  # its prepare_store looks first
        thread.join(30.0)
        assert not thread.is_alive() and server.gone is not None and "removed" in server.gone
        assert not server.check_own()
    finally:
        engine.close()
        stop(server, thread)
    assert f"stops serving: {paths.dir}" in capsys.readouterr().err


def test_an_idle_engine_holds_no_generation_of_a_node_process_its_lease_never_reached(
    share_root: Path,
) -> None:
    """Found by the fuzzer's share wipes over a shared disk: an engine's calls were
    attached to node process X while its lease was still on W (lingering after the
    share's directory was deleted); X was killed before the lease reached it and the
    lease went on to Z. The engine, idle, never called again: it held X's
    generation, and Z's fence never opened (every store of every engine no_room).
    The lease finding Z tells the engine X is gone."""
    paths = SharePaths("moved", share_root)
    lingering = open_server(paths, GEOMETRY)  # W: served without its file checks
    running = threading.Event()
    running.set()

    def serve_w() -> None:
        while running.is_set():
            lingering.serve_round(0.02)

    w_thread = threading.Thread(target=serve_w, daemon=True)
    w_thread.start()
    engine = ShareDirectory(paths, geometry=GEOMETRY, timeout_s=30.0, retry_s=0.0,
                            start_server=False)  # fmt: skip
    other: ShareDirectory | None = None
    z: tuple[ShareServer, threading.Thread] | None = None
    try:
        assert engine.wait_ready(30.0) and engine.lease is not None
        assert engine.lease.connected.wait(30.0)
        w_identity = engine.attachment.identity
        wipe(paths)
        x_server, x_thread = serve(paths)  # X: the share's files made anew
        engine.link.drop()
        engine.link._next_attempt = 0.0
        assert engine.share_counts() is not None  # the engine's calls now on X
        x_identity = engine.attachment.identity
        assert x_identity not in (None, w_identity)
        lease_welcome = engine.lease.welcome
        assert lease_welcome is not None and lease_welcome.identity == w_identity
        stop(x_server, x_thread)  # X gone before the lease ever reached it
        z = serve(paths)  # Z: the next generation, fenced while X's is held
        running.clear()
        w_thread.join()
        lingering.close()  # W goes: the lease moves on, to Z
        deadline = time.monotonic() + 30.0  # the lease thread reconnects on its own
        while (found := engine.lease.welcome) is None or found.identity in (
            w_identity,
            x_identity,
        ):
            assert time.monotonic() < deadline, "the lease never reached the new node process"
            time.sleep(0.01)
        other = ShareDirectory(paths, timeout_s=30.0, start_server=False)
        assert other.wait_ready(30.0)
        stored = other.prepare_store([K(1)])
        assert not stored.no_room  # Z's fence opened: no one holds X's generation
        other.complete_store(stored.keys, success=True)
        counts = other.share_counts()
        assert counts is not None and counts.fenced_stores == 0
    finally:
        running.clear()
        engine.close()
        if other is not None:
            other.close()
        if z is not None:
            stop(*z)
