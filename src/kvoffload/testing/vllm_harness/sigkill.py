"""What a SIGKILL leaves of a harness engine over a node-shared host tier.

The harness runs every engine in one process, so a kill is simulated (test
support): the engine's copies stop where they are (each copy not yet past its gate
fails without copying, as a dead process copies nothing more), every connection of
its session to the share's node process (the scheduler half's link and lease, each
worker's lease; the same at a shared disk tier's node process, whose leases close
with the workers' tier stores) and its generation locks close as the kernel closes them, with
nothing sent (no completion, no release), and its transfer threads end. The engine
is never called again; the node process alone must release what it booked.
"""

from __future__ import annotations

from kvoffload.core.jobs import JobKind
from kvoffload.core.keys import ChunkKey
from kvoffload.share.client import ShareDirectory
from kvoffload.testing.vllm_harness.harness import VllmHarness


def sigkill(h: VllmHarness) -> list[ChunkKey]:
    """Kill engine ``h`` (see the module docstring); the keys of the stores it had
    in flight (booked at the share, never completed)."""
    half = h.scheduler_half
    keys = [k for j in half.jobs_in_flight() if j.kind is JobKind.STORE for k in j.keys]
    for entry in h.ranks:
        for child in entry.children:
            open_ids = set(child.open_copies)
            child.gate.fail(open_ids)  # (their lane predecessors are open ones too)
            child.copier.wait(open_ids)
    share = h.side.share
    assert share is not None
    if h.side.events is not None:
        h.side.events.close()  # its announcer's feed connections
    share.directory.close()  # its sockets and generation locks: nothing is sent
    h.side.tiers.shares.pop("host")
    for tier in half.tiers.directory_tiers():  # a disk tier shared by the node's engines
        if isinstance(tier.directory, ShareDirectory):
            tier.directory.close()
    for entry in h.ranks:
        for child in entry.children:
            if child.side.share is not None:
                child.side.share.close()  # its lease's socket, its view of the slab
                child.side.share = None
            child.connector.shutdown()  # the transfer threads (the share is gone)
    return keys


def spills_in_flight(h: VllmHarness) -> list[ChunkKey]:
    """The keys of the spills engine ``h`` has in flight (booked below, never
    completed): a kill must leave none of them readable in a shared tier."""
    half = h.scheduler_half
    return [k for j in half.jobs_in_flight() if j.kind is JobKind.SPILL for k in j.keys]
