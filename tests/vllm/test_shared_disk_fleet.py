"""Harness engines over vLLM's real scheduler sharing a host share too small for their
prefixes and one disk tier below it (decision 0017): what one engine computed comes
back to another from the shared disk, checked block by block against the KV model;
the disk share's node process killed and recovered; and the regression the shared-host
fuzz shape found."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fleet_support import serve

from kvoffload.share.launch import server_alive
from kvoffload.testing.vllm_fuzz.shared_host import BLOCK_BYTES
from kvoffload.testing.vllm_harness import HarnessSpec, VllmHarness
from kvoffload.testing.vllm_harness.fleet import SharedFleet
from kvoffload.tiers.disk import slot_bytes

PREFIX = list(range(10, 58))  # three chunks of 16 tokens
OTHER = list(range(200, 248))
HOST_CHUNKS = 3  # one prompt's chunks: the next prompt evicts them from host memory


@pytest.fixture
def fleet(tiny_model: Path) -> Iterator[SharedFleet]:
    extra = {"chunk_tokens": 16, "disk_bytes": 32 * slot_bytes(BLOCK_BYTES)}
    spec = HarnessSpec(num_blocks=32, cpu_bytes=HOST_CHUNKS * BLOCK_BYTES, extra=extra)
    made = SharedFleet(tiny_model, spec, 2)
    try:
        yield made
    finally:
        made.close()
    assert made.disk is not None and made.disk.paths is not None
    assert not server_alive(made.disk.paths)  # the disk share's node process was stopped
    assert not made.root.exists()


def disk_reads(h: VllmHarness) -> int:
    tier = h.scheduler_half.tiers.tier("disk")
    assert tier is not None
    moved = tier.metrics.breakdown("transferred_chunks_total", "direction")
    return moved.get("load", 0) + moved.get("promote", 0)


def spilled_away(fleet: SharedFleet) -> None:
    """Engine 0 computes PREFIX, then OTHER: PREFIX leaves the host share, kept on disk."""
    serve(fleet, 0, "a", [*PREFIX, 1])
    serve(fleet, 0, "a2", [*OTHER, 1])
    host = fleet.counts()
    assert host is not None and host.chunks <= HOST_CHUNKS
    assert fleet.disk is not None
    counts = fleet.disk.counts()
    assert counts is not None and counts.chunks >= 6  # both prompts written through


def test_an_engine_reads_from_the_shared_disk_what_another_computed(fleet: SharedFleet) -> None:
    spilled_away(fleet)
    b = serve(fleet, 1, "b", [*PREFIX, 2])
    assert b.loaded_tokens("b") == len(PREFIX)  # its KV checked block by block
    assert disk_reads(b) >= 1
    fleet.quiescent()


def test_a_tier_load_with_no_host_chunk_while_the_host_share_is_down(fleet: SharedFleet) -> None:
    # Regression (shared-host fuzz, seed 31): with the host share's node process dead,
    # a load whose chunks all come from the disk pinned an empty list of host chunks
    # at the dead share, was refused, and the load counted chunk_gone.
    spilled_away(fleet)
    fleet.kill_node()
    b = serve(fleet, 1, "b", [*PREFIX, 2])  # (the harness fails on any anomaly)
    assert b.loaded_tokens("b") == len(PREFIX)
    assert disk_reads(b) >= 1
    fleet.quiescent()


def test_a_killed_disk_node_process_is_replaced_and_recovers_the_slabs(
    fleet: SharedFleet,
) -> None:
    spilled_away(fleet)
    fleet.kill_disk_node()
    assert fleet.stats["disk_node_kills"] == 1
    for n in range(4):  # engine 1's calls start a new node process within a few steps
        serve(fleet, 1, f"b{n}", [300 + n, 7, 8])
    assert fleet.disk is not None and fleet.disk.paths is not None
    deadline = time.monotonic() + 30.0  # it recovers on its own once fenced: bounded
    while (counts := fleet.disk.counts()) is None or counts.chunks < 6:
        assert time.monotonic() < deadline, f"not recovered: {counts}"
        time.sleep(0.01)
    fleet.disk.note_node()
    b = serve(fleet, 1, "c", [*PREFIX, 2])
    assert b.loaded_tokens("c") == len(PREFIX)  # from the recovered disk, KV checked
    fleet.quiescent()
