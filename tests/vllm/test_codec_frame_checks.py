"""A host-memory slot whose bytes changed after its store, on vLLM's real scheduler
(issue 41): with ``codec`` lossless or fp8 the load of that slot fails its frame
checksum, which is a counted load failure, never a crash: the host copy is
forgotten, the request recomputes its prefix (the harness checks every forward pass
reads its own KV), and a later request loads the prefix stored again."""

from __future__ import annotations

from typing import Any

import pytest

PREFIX = list(range(10, 74))  # 64 tokens: 4 blocks of 16, one chunk each


@pytest.mark.parametrize("codec", ["lossless", "fp8"])
def test_a_changed_host_slot_is_a_counted_miss_and_recomputed(make: Any, codec: str) -> None:
    h = make(extra={"codec": codec})
    h.add_request("a", PREFIX, max_tokens=2)
    h.run()
    (store,) = [j for r in h.steps for j in r.plan.stores if j.request_id == "a"]
    worker = h.ranks[0].children[0].copier
    slot = worker.slab.data[store.slots[1]]
    used = worker.codec.used_bytes(slot.numpy().data)  # lossless: the frame's end
    slot[used // 2] ^= 0x40  # one bit in the middle of the second chunk's frame
    h.scheduler.reset_prefix_cache()
    h.add_request("b", [*PREFIX, 5, 6], max_tokens=2)
    h.run()
    half = h.scheduler_half
    (load,) = [j for r in h.steps for j in r.loads_for("b")]
    assert store.slots[1] in load.slots
    assert half.stats.load_failures == 1 and h.loads_checked == 0
    failed = half.metrics.value("failed_chunks_total", direction="load", tier="host")
    assert failed == len(load.keys)  # every chunk of the failed load is forgotten
    assert sum(r.scheduled.get("b", 0) for r in h.steps) >= len(PREFIX)  # recomputed
    h.scheduler.reset_prefix_cache()
    h.add_request("c", [*PREFIX, 7, 8], max_tokens=2)
    h.run()
    assert h.loads_checked == 1  # b stored the prefix again; c loads it, checked
    assert half.stats.load_failures == 1
    half.check_integrity()
