"""Issue 34's done-when as a user runs it: two ``vllm serve`` processes (each with
vLLM's own ZMQ event publisher and its engine in a process of its own) on one
64-chunk ``host_share``, Dynamo's KV indexer registered with both once their
publishers are bound.

Server A answers prompt 0 (8 blocks, as token ids over HTTP), then other prompts until
the indexer no longer credits prompt 0 to A's engine memory: the indexer must then
credit A and B (which served only its probe) with at least 7 of the 8 blocks in host
memory. A then floods the share (72 more chunks), and the indexer must credit B with at
most one block of prompt 0. Servers, the node process and the indexer are stopped by
pid, on failure too; wall times are never asserted.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from dynamo_support import Answer, credited, indexer, poll
from share_support import share_config, stop_node_process
from test_serve import BLOCK_BYTES, served_model

from kvoffload.testing.ports import free_port
from kvoffload.testing.vllm_server import VllmServer

pytestmark = pytest.mark.slow

__all__ = ["served_model"]  # the fixture, imported for this module's tests

BLOCK = 32
BLOCKS = 8
A, B = 1, 2


def prompt(p: int) -> list[int]:
    return [(7 * p + 3 * i) % 997 + 5 for i in range(BLOCKS * BLOCK)]


def complete(server: VllmServer, tokens: list[int]) -> None:
    body = {"model": server.model, "prompt": tokens, "max_tokens": 1, "temperature": 0}
    req = urllib.request.Request(
        f"{server.base_url}/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(req, timeout=120) as r:
        assert json.loads(r.read())["choices"], "no completion"


def host_blocks(answer: Answer, worker: int) -> int:
    return (answer[worker]["cpu"] - answer[worker]["gpu"]) // BLOCK


def test_two_servers_on_one_share_are_both_credited(served_model: Path, tmp_path: Path) -> None:
    extra: dict[str, Any] = share_config(tmp_path / "shm", "serve-router", 64 * BLOCK_BYTES)
    ports = {A: free_port(), B: free_port()}
    servers = {}
    for worker, cores in ((A, "0"), (B, "1")):
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{ports[worker]}"}  # fmt: skip
        transfer = {"kv_connector": "KVOffloadConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": extra}  # fmt: skip
        args = ["--kv-transfer-config", json.dumps(transfer), "--kv-events-config",
                json.dumps(events)]  # fmt: skip
        servers[worker] = VllmServer(
            served_model, tmp_path / f"server-{worker}.log", args,
            kv_cache_bytes=20 * BLOCK_BYTES, max_model_len=320, cores=cores,
        )  # fmt: skip
    router = indexer(BLOCK, tmp_path / "indexer.log")
    try:
        for server in servers.values():
            server.start()
        router.start(ports)  # both publishers are bound: the servers answer
        for worker, server in servers.items():
            for n in range(20):
                probe = [(11 * n + 5 * i + 100 * worker) % 991 + 5 for i in range(BLOCK + 1)]
                complete(server, probe)
                if poll(lambda t=probe: router.query(t[:BLOCK]),
                        lambda ans, w=worker: ans[w]["gpu"] == BLOCK, within=2.0):  # fmt: skip
                    break
            else:
                raise AssertionError(f"the indexer never credited server {worker}'s probe")
        p0 = prompt(0)
        complete(servers[A], p0)
        credited(lambda: router.query(p0), lambda ans: ans[A]["gpu"] == BLOCKS * BLOCK)
        filler = 1
        while router.query(p0)[A]["gpu"] > 0:  # until prompt 0 left A's engine memory
            assert filler < 6, "prompt 0 never left A's engine memory"
            complete(servers[A], prompt(filler))
            filler += 1
        both = credited(
            lambda: router.query(p0),
            lambda ans: host_blocks(ans, A) >= 7 and host_blocks(ans, B) >= 7,
        )
        for n in range(filler, filler + 9):  # 72 more chunks: more than the share holds
            complete(servers[A], prompt(n))
        flooded = credited(lambda: router.query(p0), lambda ans: host_blocks(ans, B) <= 1)
        print(f"credited once out of A's engine: {both}; after the flood: {flooded}")
        assert both[B]["gpu"] == 0
    finally:
        router.stop()
        for server in servers.values():
            server.stop()
        stop_node_process(extra)
