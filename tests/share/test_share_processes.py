"""Engines in processes of their own on one share: sharing chunks, SIGKILL of an
engine mid-store and mid-load, SIGKILL of the node process, a restarted engine."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from share_fixtures import Agent

from kvoffload.core.chunk_state import ChunkState
from kvoffload.core.directory import LookupStatus
from kvoffload.core.keys import ChunkKey
from kvoffload.share.client import ShareDirectory
from kvoffload.share.launch import Spawned
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.paths import SharePaths
from kvoffload.tiers.host_shared_slab import SharedSlab

GEOMETRY = ShareGeometry(num_slots=8, slot_bytes=8192)
HIT, MISS = LookupStatus.HIT, LookupStatus.MISS
AgentFactory = Callable[[SharePaths, bytes], Agent]
NodeFactory = Callable[[str, ShareGeometry], Spawned]


def K(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def engine(paths: SharePaths, **options: object) -> tuple[ShareDirectory, SharedSlab]:
    """The test process's own engine: a directory client and rank 0's slab."""
    options.setdefault("timeout_s", 30.0)
    options.setdefault("start_server", False)
    directory = ShareDirectory(paths, **options)  # type: ignore[arg-type]
    assert directory.wait_ready(60.0)
    geometry = ShareGeometry.read(paths)
    assert geometry is not None
    return directory, SharedSlab(paths, geometry, 0, geometry.slot_bytes, pin_memory=False)


def read_slot(directory: ShareDirectory, slab: SharedSlab, key: ChunkKey) -> bytes:
    slot = directory.prepare_load([key])[0]
    data = bytes(slab.slot_bytes(slot))
    directory.complete_load([key])
    return data


def test_two_engines_share_chunks_through_one_slab(
    share_root: Path, node: NodeFactory, agents: AgentFactory
) -> None:
    node("two", GEOMETRY)
    paths = SharePaths("two", share_root)
    a = agents(paths, os.urandom(16))
    assert a.ask(f"store {K(1).hex()} 7").startswith("stored")
    b, slab = engine(paths)
    assert b.lookup([K(1), K(2)]).statuses == (HIT, MISS)
    assert read_slot(b, slab, K(1)) == bytes([7]) * GEOMETRY.slot_bytes
    prepared = b.prepare_store([K(2)])
    slab.slot_bytes(prepared.slots[0])[:] = bytes([9]) * GEOMETRY.slot_bytes
    b.complete_store(prepared.keys, success=True)
    assert a.ask(f"read {K(2).hex()}") == "read 9,9"
    assert b.prepare_store([K(1)]).keys == ()  # one copy of each chunk, whoever stored it
    b.check_integrity()
    b.close()


def test_an_engine_killed_mid_store_and_mid_load_is_released(
    share_root: Path, node: NodeFactory, agents: AgentFactory
) -> None:
    node("kill", GEOMETRY)
    paths = SharePaths("kill", share_root)
    b, slab = engine(paths)
    kept = b.prepare_store([K(1)])
    slab.slot_bytes(kept.slots[0])[:] = bytes([1]) * GEOMETRY.slot_bytes
    b.complete_store(kept.keys, success=True)
    writer = agents(paths, os.urandom(16))
    assert writer.ask(f"half {K(2).hex()} 5").startswith("booked")
    reader = agents(paths, os.urandom(16))
    assert reader.ask(f"pin {K(1).hex()}") == f"pinned {kept.slots[0]}"
    assert b.pins_of(K(1)) == 1 and b.state_of(K(2)) is ChunkState.STORING
    writer.kill()
    reader.kill()
    counts = b.share_counts()
    assert counts is not None
    assert counts.storing == 0 and counts.pinned == 0 and counts.sessions == 1
    assert b.lookup([K(1), K(2)]).statuses == (HIT, MISS)  # the half-written chunk: never
    assert read_slot(b, slab, K(1)) == bytes([1]) * GEOMETRY.slot_bytes  # others' intact
    assert b.prepare_store([K(2)]).keys == (K(2),)  # its slot was freed
    b.check_integrity()
    b.close()


def test_a_restarted_engine_is_warm(
    share_root: Path, node: NodeFactory, agents: AgentFactory
) -> None:
    node("warm", GEOMETRY)
    paths = SharePaths("warm", share_root)
    first = agents(paths, os.urandom(16))
    for i in (1, 2):
        assert first.ask(f"store {K(i).hex()} {i}").startswith("stored")
    first.kill()
    again = agents(paths, os.urandom(16))
    assert again.ask(f"lookup {K(1).hex()} {K(2).hex()} {K(3).hex()}") == "prefix 2"
    assert again.ask(f"read {K(2).hex()}") == "read 2,2"


def test_a_killed_node_process_costs_a_miss_and_a_new_one_starts_empty(
    share_root: Path, node: NodeFactory
) -> None:
    spawned = node("node", GEOMETRY)
    paths = SharePaths("node", share_root)
    b, slab = engine(paths, geometry=GEOMETRY, start_server=True, retry_s=0.0)
    stored = b.prepare_store([K(1)])
    b.complete_store(stored.keys, success=True)
    in_flight = b.prepare_store([K(2)])  # a store still being copied when the node dies
    spawned.process.kill()
    spawned.process.wait()
    assert b.readable_prefix([K(1)]) == 0  # a miss, not an exception
    assert b.lookup([K(1)]).statuses == (MISS,)  # ...and this call started a new one
    assert b.link.stats["server_starts"] == 1
    assert b.link.spawned is not None
    try:
        assert b.wait_ready(60.0)
        assert b.link.welcome is not None and b.link.welcome.generation == 2
        assert b.lookup([K(1), K(2)]).statuses == (MISS, MISS)  # it starts empty
        # The store booked under the dead node process is still being copied: the new
        # one books no slot (which could be that one) until it is reported.
        assert b.prepare_store([K(3)]).no_room
        b.complete_store(in_flight.keys, success=True)  # settled here, never readable
        assert b.lookup([K(2)]).statuses == (MISS,)
        again = b.prepare_store([K(3)])
        assert again.keys == (K(3),)
        b.complete_store(again.keys, success=True)
        assert b.lookup([K(3)]).statuses == (HIT,)
        assert b.pinned_count == 0 and b.storing_count == 0
        b.check_integrity()
    finally:
        b.close()
        b.link.spawned.process.kill()
        b.link.spawned.process.wait()
    slab.close()


@pytest.mark.parametrize("role", ["scheduler", "worker"])
def test_a_session_stays_open_while_any_process_of_the_engine_lives(
    share_root: Path, node: NodeFactory, agents: AgentFactory, role: str
) -> None:
    """An engine's worker holding a lease keeps its bookings (it may still be copying)
    after the scheduler half's process died, and they are released when it dies."""
    node("lease", GEOMETRY)
    paths = SharePaths("lease", share_root)
    session = os.urandom(16)
    scheduler = agents(paths, session)
    worker = agents(paths, session)  # stands in for a worker: same session
    assert scheduler.ask(f"half {K(4).hex()} 3").startswith("booked")
    b, _ = engine(paths)
    first, second = (scheduler, worker) if role == "scheduler" else (worker, scheduler)
    first.kill()
    assert b.state_of(K(4)) is ChunkState.STORING  # still booked: the engine lives
    second.kill()
    assert b.state_of(K(4)) is ChunkState.FREE
    counts = b.share_counts()
    assert counts is not None and counts.sessions == 1
    b.close()


def test_engines_storing_and_loading_at_once_never_read_torn_bytes(
    share_root: Path, node: NodeFactory, agents: AgentFactory
) -> None:
    """Two engines churn through a share much smaller than their chunks (constant
    evictions): every load reads its chunk's own bytes, whatever the other one does."""
    node("churn", GEOMETRY)
    paths = SharePaths("churn", share_root)
    one, two = agents(paths, os.urandom(16)), agents(paths, os.urandom(16))
    assert one.process.stdin is not None and two.process.stdin is not None
    for agent, seed in ((one, 1), (two, 2)):
        agent.process.stdin.write(f"churn 400 {seed}\n")
        agent.process.stdin.flush()
    answers = [one.ask(None), two.ask(None)]
    loads = [int(a.split()[1].split("=")[1]) for a in answers]
    assert all(a.endswith("bad=0") for a in answers) and min(loads) > 0, answers
