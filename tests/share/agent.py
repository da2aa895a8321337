"""An engine stand-in for the share's tests, in a process of its own.

``python agent.py ROOT NAME SESSION_HEX`` opens a :class:`ShareDirectory` and rank 0's
:class:`SharedSlab` of share NAME, then obeys one command per stdin line, answering
one stdout line each (the test reads it before going on: no sleeps)::

    store KEY BYTE     book KEY, fill its slot with BYTE, complete it -> "stored SLOT"
    half KEY BYTE      book KEY, fill half its slot with BYTE         -> "booked SLOT"
    pin KEY            pin KEY for a load                             -> "pinned SLOT"
    read KEY           pin, read the slot, unpin -> "read BYTE,BYTE" (its first and last byte)
    lookup KEY...      -> "prefix N"
    churn ROUNDS SEED  store and load at random, checking bytes -> "churned loads=N bad=M"

KEY is hex. The test kills the agent with SIGKILL, or closes stdin to end it.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

from kvoffload.core.keys import ChunkKey
from kvoffload.share.client import ShareDirectory
from kvoffload.share.paths import SharePaths
from kvoffload.tiers.host_shared_slab import SharedSlab


def churn(directory: ShareDirectory, slab: SharedSlab, rounds: int, seed: int) -> str:
    """Store and load chunks of a small universe at random, each chunk's bytes all
    equal to its key's last byte; count loads that read anything else."""
    rng = random.Random(seed)
    universe = [ChunkKey(bytes(15) + bytes([i])) for i in range(1, 40)]
    loads = bad = 0
    for _ in range(rounds):
        key = rng.choice(universe)
        prepared = directory.prepare_store([key])
        if prepared.keys:
            slab.slot_bytes(prepared.slots[0])[:] = key[-1:] * slab.chunk_bytes
            directory.complete_store(prepared.keys, success=True)
        key = rng.choice(universe)
        if directory.readable_prefix([key]):
            slots = directory.try_prepare_load([key])
            if slots is not None:
                loads += 1
                bad += bytes(slab.slot_bytes(slots[0])) != key[-1:] * slab.chunk_bytes
                directory.complete_load([key])
    return f"churned loads={loads} bad={bad}"


def main() -> None:
    root, name, session = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3])
    paths = SharePaths(name, Path(root))
    directory = ShareDirectory(paths, session=session, timeout_s=5.0, start_server=False)
    if not directory.wait_ready(30.0):
        raise SystemExit("no share")
    welcome = directory.link.welcome
    assert welcome is not None
    from kvoffload.share.meta import ShareGeometry

    geometry = ShareGeometry.read(paths)
    assert geometry is not None
    slab = SharedSlab(paths, geometry, 0, geometry.slot_bytes, pin_memory=False)
    print("ready", flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        keys = [] if command == "churn" else [ChunkKey(bytes.fromhex(a)) for a in args[:1]]
        if command in ("store", "half"):
            prepared = directory.prepare_store(keys)
            slot = prepared.slots[0]
            data = slab.slot_bytes(slot)
            end = len(data) if command == "store" else len(data) // 2
            data[:end] = bytes([int(args[1])]) * end
            if command == "store":
                directory.complete_store(prepared.keys, success=True)
            print(("stored" if command == "store" else "booked"), slot, flush=True)
        elif command == "pin":
            print("pinned", directory.prepare_load(keys)[0], flush=True)
        elif command == "read":
            slot = directory.prepare_load(keys)[0]
            data = bytes(slab.slot_bytes(slot))
            directory.complete_load(keys)
            print(f"read {data[0]},{data[-1]}", flush=True)
        elif command == "churn":
            print(churn(directory, slab, int(args[0]), int(args[1])), flush=True)
        elif command == "lookup":
            many = [ChunkKey(bytes.fromhex(a)) for a in args]
            print("prefix", directory.readable_prefix(many), flush=True)
    directory.close()


if __name__ == "__main__":
    main()
