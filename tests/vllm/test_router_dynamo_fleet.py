"""Two engines on one node-shared host tier behind Dynamo's KV indexer (issue 34's
done-when): every engine attached to the share is credited with what the share holds.

Engines A and B are separate processes (``share_support.Child``: an in-process
``LLM`` each), each with vLLM's own ZMQ event publisher, on one ``host_share`` of 64
chunks (one 32-token block each) and an engine KV cache of 20 blocks. The indexer
(``kvoffload.testing.dynamo_indexer``) is started once both publishers are bound, with A as
worker 1 and B as worker 2.

The run: A serves prompt 0 (8 blocks); A serves other prompts until the indexer no
longer credits prompt 0 to A's engine memory (it left it); then the indexer must
credit A **and B** (which served nothing but its probe) with at least 7 of the 8
blocks in host memory. Engine C (worker 3, listed from the start) is started then: it
attaches to a share that already holds prompt 0 and, serving nothing, must be
credited with it too. A then floods the share (more than 64 chunks of other
prompts), and the indexer must credit B and C with at most one block of prompt 0.

B's announcements come from its share announcer's thread through vLLM's publisher
(``adapters/vllm/event_sink.py``): B takes no engine step between its probe and the
checks (it is never asked to), which the test asserts from B's own counts (its
announcer's events were handed to the publisher directly, none waited for a step).
Every process is stopped by pid, on failure too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from dynamo_support import Answer, credited, indexer, poll
from llm_support import BLOCK, CHUNK_BYTES
from share_support import Child, share_config, stop_node_process

from kvoffload.testing.ports import free_port

pytestmark = pytest.mark.slow

BLOCKS = 8
A, B, C = 1, 2, 3


def prompt(p: int) -> list[int]:
    """Prompt ``p``: 8 blocks, no block shared with another prompt."""
    return [(7 * p + 3 * i) % 997 + 3 for i in range(BLOCKS * BLOCK)]


def probe(n: int) -> list[int]:
    return [(11 * n + 5 * i) % 991 + 5 for i in range(BLOCK + 1)]


def host_blocks(answer: Answer, worker: int) -> int:
    """Blocks credited to ``worker``'s host memory (the indexer's ``cpu`` includes ``gpu``)."""
    mine = answer[worker]
    return (mine["cpu"] - mine["gpu"]) // BLOCK


def test_every_engine_on_the_share_is_credited_and_uncredited(
    tiny_model: Path, tmp_path: Path
) -> None:
    extra = share_config(tmp_path / "shm", "fleet", 64 * CHUNK_BYTES)
    ports = {A: free_port(), B: free_port(), C: free_port()}
    options: dict[str, Any] = {"kv_blocks": 20, "max_num_seqs": 1, "max_model_len": 320}
    children: list[Child] = []
    try:

        def start(worker: int) -> Child:
            child = Child(tiny_model, extra, tmp_path / f"engine-{worker}.log",
                          {**options, "kv_events_port": ports[worker]})  # fmt: skip
            children.append(child)
            return child

        def subscribed(worker: int, child: Child) -> None:
            """Serve fresh probes until the indexer credits one (ZMQ drops what is
            published before a subscriber joins)."""
            for n in range(20):
                tokens = probe(100 * worker + n)
                child.ask(prompts=[tokens])
                if poll(lambda t=tokens: router.query(t[:BLOCK]),
                        lambda ans, w=worker: ans[w]["gpu"] == BLOCK, within=2.0):  # fmt: skip
                    return
            raise AssertionError(f"the indexer never credited worker {worker}'s probe")

        a, b = start(A), start(B)
        with indexer(BLOCK, tmp_path / "indexer.log").start(ports) as router:
            subscribed(A, a)
            subscribed(B, b)
            before_b = b.ask(report=True)
            p0 = prompt(0)
            a.ask(prompts=[p0])
            credited(lambda: router.query(p0), lambda ans: ans[A]["gpu"] == BLOCKS * BLOCK)
            filler = 1
            while router.query(p0)[A]["gpu"] > 0:  # until prompt 0 left A's engine memory
                assert filler < 6, "prompt 0 never left A's engine memory"
                a.ask(prompts=[prompt(filler)])
                filler += 1
            both = credited(
                lambda: router.query(p0),
                lambda ans: host_blocks(ans, A) >= 7 and host_blocks(ans, B) >= 7,
            )
            c = start(C)  # attaches to a share that holds prompt 0 already, serves nothing
            late = poll(lambda: router.query(p0), lambda ans: host_blocks(ans, C) >= 7, 60)
            assert late is not None, f"C not credited: {router.query(p0)}, {c.ask(report=True)}"
            for n in range(filler, filler + 9):  # 72 more chunks: more than the share holds
                a.ask(prompts=[prompt(n)])
            flooded = credited(
                lambda: router.query(p0),
                lambda ans: host_blocks(ans, B) <= 1 and host_blocks(ans, C) <= 1,
            )
            after_b = b.ask(report=True)
        print(f"fillers {filler - 1}; credited once out of A's engine: {both}; "
              f"C once started: {late}; after the flood: {flooded}; "
              f"B's announcer: {after_b['announcer']}")  # fmt: skip
        assert both[B]["gpu"] == 0 and host_blocks(both, B) >= 7
        assert host_blocks(flooded, B) <= 1
        # B took no step since its probe: its announcements reached its publisher
        # from the announcer's thread.
        assert after_b["steps"] == before_b["steps"]
        assert after_b["announcer"]["direct"] > before_b["announcer"]["direct"]
        assert after_b["announcer"]["removed"] >= 7 and after_b["announcer"]["bad_records"] == 0
    finally:
        for child in children:
            child.close()
        stop_node_process(extra)
