"""Several harness engines over one node-shared host tier (``vllm_harness/fleet.py``):
a chunk one engine stored loads into another with exactly the KV computed for its
prefix; a killed engine's in-flight stores never become readable and its pins go;
a killed node process means misses, then a new node process serves again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fleet_support import serve

from kvoffload.core.directory import LookupStatus
from kvoffload.share.launch import server_alive
from kvoffload.testing.vllm_fuzz.shared_host import BLOCK_BYTES
from kvoffload.testing.vllm_harness import HarnessSpec
from kvoffload.testing.vllm_harness.fleet import SharedFleet
from kvoffload.testing.vllm_harness.share_faults import stop_share, wipe_share

PREFIX = list(range(10, 58))  # three chunks of 16 tokens
OTHER = list(range(200, 248))
THIRD = list(range(300, 348))


@pytest.fixture
def fleet(tiny_model: Path) -> Iterator[SharedFleet]:
    spec = HarnessSpec(num_blocks=32, cpu_bytes=16 * BLOCK_BYTES, extra={"chunk_tokens": 16})
    made = SharedFleet(tiny_model, spec, 2)
    try:
        yield made
    finally:
        made.close()
    assert not server_alive(made.paths)  # the node process was stopped
    assert not made.root.exists()


def test_an_engine_loads_what_another_stored_and_gets_its_kv(fleet: SharedFleet) -> None:
    serve(fleet, 0, "a", [*PREFIX, 1, 2])
    b = serve(fleet, 1, "b", [*PREFIX, 3])
    assert b.loaded_tokens("b") == len(PREFIX)  # every chunk came from engine 0's store
    assert fleet.stats["cross_engine_loads"] == 1
    assert b.loads_checked == 1  # its blocks held the KV of its prefix, checked
    fleet.quiescent()


def test_a_killed_engine_in_flight_stores_never_become_readable(fleet: SharedFleet) -> None:
    a = fleet.engine(0)
    a.add_request("a", [*PREFIX, 1], 3)
    fleet.step(0, complete=False)  # its stores are booked, their copies held
    keys = fleet.kill(0)  # (checks they are not readable and the share's bookings)
    assert len(keys) == 3
    assert fleet.observer is not None
    assert set(fleet.observer.lookup(keys).statuses) == {LookupStatus.MISS}
    counts = fleet.counts()
    assert counts is not None
    assert (counts.storing, counts.pinned, counts.sessions) == (0, 0, 2)
    b = serve(fleet, 1, "b", [*PREFIX, 2])
    assert b.loaded_tokens("b") == 0  # nothing of engine 0's reached it
    assert fleet.stats["engine_kills"] == 1
    fleet.quiescent()


def test_a_killed_engine_pins_are_released_and_the_others_keep_serving(
    fleet: SharedFleet,
) -> None:
    serve(fleet, 0, "a", [*PREFIX, 1])
    b = fleet.engine(1)
    b.add_request("b", [*PREFIX, 2], 3)
    fleet.step(1, complete=False)  # its load pinned engine 0's chunks, copies held
    counts = fleet.counts()
    assert counts is not None and counts.pinned == 3
    fleet.kill(1)
    counts = fleet.counts()
    assert counts is not None and (counts.pinned, counts.sessions) == (0, 2)
    again = serve(fleet, 0, "c", [*OTHER, 4])
    assert again.scheduler_half.stats.stores >= 2
    fleet.quiescent()


def test_a_restarted_engine_hits_what_survived_it(fleet: SharedFleet) -> None:
    serve(fleet, 0, "a", [*PREFIX, 1])
    fleet.kill(0)
    fleet.restart(0)
    h = serve(fleet, 0, "b", [*PREFIX, 2])
    assert h.loaded_tokens("b") == len(PREFIX)
    assert fleet.stats["restart_loads"] == 1
    fleet.quiescent()


def test_a_killed_node_process_means_misses_then_a_new_one_serves(fleet: SharedFleet) -> None:
    serve(fleet, 0, "a", [*PREFIX, 1])
    fleet.kill_node()
    b = serve(fleet, 1, "b", [*PREFIX, 2])  # a miss: recomputed, no exception
    assert b.loaded_tokens("b") == 0
    for n in range(8):  # engine 1 restarts the node process within a few steps
        serve(fleet, 1, f"b{n}", [*OTHER, n])
    assert server_alive(fleet.paths)
    assert fleet.stats["recoveries"] == 1
    for n in range(4):  # engine 0's first call fails too: it reconnects a few steps on
        serve(fleet, 0, f"a{n}", [500 + n, 7, 8])
    assert fleet.stats["recoveries"] == 2
    a = serve(fleet, 0, "c", [*OTHER, 99])  # engine 0 loads what engine 1 stored since
    assert a.loaded_tokens("c") == len(OTHER)
    assert fleet.stats["cross_engine_loads"] == 1
    fleet.quiescent()


def test_stale_bookings_of_a_killed_node_process_settle_and_kills_still_check(
    fleet: SharedFleet,
) -> None:
    b = fleet.engine(1)
    b.add_request("b", [*PREFIX, 1], 3)
    fleet.step(1, complete=False)  # stores booked at the first node process, in flight
    fleet.kill_node()
    for n in range(4):  # engine 0 starts a new node process and attaches to it
        serve(fleet, 0, f"a{n}", [*OTHER, n])
    assert fleet.stats["recoveries"] == 1
    fleet.kill(0)  # the share's bookings: engine 1's current ones (none), not its stale
    while b.busy():  # its stale stores complete into a dead generation: never readable
        fleet.step(1)
    assert b.output_tokens("b") == b.model.reference_output("b", [*PREFIX, 1], 3)
    fleet.quiescent()


def test_an_engine_killed_while_no_node_process_runs(fleet: SharedFleet) -> None:
    """Regression (fuzz seed 474, async): the fleet's kill checked readability
    through a node process that was not running."""
    a = fleet.engine(0)
    a.add_request("a", [*PREFIX, 1], 3)
    fleet.step(0, complete=False)  # stores in flight
    fleet.kill_node()
    assert fleet.counts() is None
    assert len(fleet.kill(0)) == 3  # nothing readable: no node process, none started
    for n in range(4):  # engine 1 starts a new one, empty
        b = serve(fleet, 1, f"b{n}", [*PREFIX, 2, n])
    assert b.loaded_tokens("b0") == 0
    fleet.quiescent()


def test_a_share_wiped_under_live_engines_never_serves_what_a_dead_mapping_holds(
    fleet: SharedFleet,
) -> None:
    """Regression (issue 30, bug 4): the share's directory deleted wholesale (systemd's
    RemoveIPC) while engine 0 has stores in flight on its slab mapping. A new node
    process makes new slab files, a restarted engine 1 maps them; engine 0's stores
    planned for them fail while its old copies are in flight (never readable), its
    workers then map the new slab, and engine 1 loads exactly the KV engine 0
    computed, never the zero bytes of the new file (without the slab id check it
    does: engine 0 kept writing its dead mapping)."""
    a = fleet.engine(0)
    a.add_request("a", [*PREFIX, 1], 3)
    fleet.step(0, complete=False)  # stores booked in the old slab, their copies held
    wipe_share(fleet, kill_first=False)  # the node process leaves its deleted files
    for n in range(4):  # engine 1 starts a node process with new slab files
        serve(fleet, 1, f"b{n}", [*OTHER, n])
    assert fleet.slab_remaps == 1  # engine 1's worker moved to them
    fleet.kill(1)
    fleet.restart(1)  # a new engine process: it maps the new slab file from the start
    a.add_request("a2", [*THIRD, 2], 3)
    for _ in range(8):  # its first copies still held: it reconnects, plans for the new slab
        fleet.step(0, complete=False)
    while a.busy():
        fleet.step(0)
    assert a.output_tokens("a2") == a.model.reference_output("a2", [*THIRD, 2], 3)
    assert a.scheduler_half.stats.store_failures >= 1  # planned for the new slab, refused
    serve(fleet, 0, "a3", [*THIRD, 3])  # stored into the new slab now
    assert fleet.slab_remaps == 2  # engine 0's worker too, once its copies were done
    b = serve(fleet, 1, "c", [*THIRD, 4])
    assert b.loaded_tokens("c") == len(THIRD) and b.loads_checked == 1  # its KV, checked
    assert fleet.stats["share_wipes"] == 1
    fleet.quiescent()


def test_share_stop_and_a_refused_remove_under_live_engines(fleet: SharedFleet) -> None:
    """``kvoffload share stop`` then ``remove`` under live engines: the remove is
    refused (the fleet checks it, and that every file stays), the engines start a
    node process on their own, which keeps the slab files: no worker remaps."""
    serve(fleet, 0, "a", [*PREFIX, 1])
    stop_share(fleet)
    assert fleet.stats["share_stops"] == 1
    for n in range(4):
        serve(fleet, 1, f"b{n}", [*OTHER, n])
    assert server_alive(fleet.paths)
    for n in range(4):  # engine 0's first call fails: it reconnects a few steps on
        serve(fleet, 0, f"a{n}", [500 + n, 7, 8])
    assert fleet.slab_remaps == 0  # the same slab files, kept by the new node process
    a = serve(fleet, 0, "c", [*OTHER, 99])  # engine 0 loads what engine 1 stored since
    assert a.loaded_tokens("c") == len(OTHER)
    fleet.quiescent()
