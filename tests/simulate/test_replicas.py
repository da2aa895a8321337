"""Several engine replicas over one shared host tier, or a private tier each."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from sim_helpers import CHUNK, CHUNK_BYTES, config, seg

from kvoffload.core.directory import Directory
from kvoffload.core.errors import UsageError
from kvoffload.core.keys import ChunkKey
from kvoffload.simulate.chat import ChatTrace
from kvoffload.simulate.command import main
from kvoffload.simulate.groups import parse_kv_groups
from kvoffload.simulate.host_ledger import HostLedger
from kvoffload.simulate.replica_report import ReplicasResult, format_replicas
from kvoffload.simulate.replicas import ReplicaSetup, run_replicas
from kvoffload.simulate.routing import Router
from kvoffload.simulate.runner import run_simulation
from kvoffload.simulate.trace import TraceRequest
from kvoffload.workload.chat import ChatWorkload

DOC = ("doc", 10 * CHUNK)  # ten full chunks


def chat(users: int = 16, concurrent: int = 7, rate: float = 40.0) -> ChatTrace:
    shape = ChatWorkload(users=users, turns=4, system_tokens=96, output_tokens=24)
    return ChatTrace(dataclasses.replace(shape, user_tokens=(8, 40)), concurrent, rate)


def replicas(
    requests: list[TraceRequest], n: int = 2, shared: bool = True, **overrides: Any
) -> ReplicasResult:
    return run_replicas(config(**overrides), ReplicaSetup(n, shared), requests)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"cpu_bytes": 0},
        {"engine_tokens": 1024},  # preemptions
        {"cpu_bytes": 8 * CHUNK_BYTES, "store_threshold": 2},
        {"kv_groups": parse_kv_groups("full,window=64")},
    ],
)
def test_one_replica_reproduces_a_run_of_one_engine(overrides: dict[str, Any]) -> None:
    requests = list(chat(rate=400.0).requests())
    alone = run_simulation(config(**overrides), requests).as_json()
    one = run_replicas(config(**overrides), ReplicaSetup(1), requests).total.as_json()
    del alone["wall_s"], one["wall_s"]
    assert alone["requests"] == 64 and alone["engine_steps"] > 0
    assert one == alone


def test_replica_b_hits_from_the_share_what_replica_a_stored() -> None:
    # Round-robin: the first request goes to replica 0, the second to replica 1.
    trace = [seg(0.0, DOC), seg(10.0, DOC, ("question", 16))]
    shared = replicas(trace, shared=True)
    private = replicas(trace, shared=False)
    a, b = shared.rows
    assert a.host_stored_chunks == 10 and a.kvoffload_hit_tokens == 0
    assert b.kvoffload_hit_tokens == 10 * CHUNK  # every full chunk of the document
    assert b.host_stored_chunks == 0  # its own chunks were there already: nothing copied
    assert private.rows[1].kvoffload_hit_tokens == private.rows[1].engine_hit_tokens == 0
    assert private.total.tier("host").written == 20  # type: ignore[union-attr]


def test_a_chunk_is_readable_to_another_replica_only_once_its_store_is_reported() -> None:
    # A prefills the document in one step, its store copies in microseconds after it,
    # and A's next step (three decode tokens, 0.9 ms) reports it. B asking between the
    # copy and that report finds the chunks still storing and waits for them; B asking
    # after the report loads them at once.
    prefill_end = 10 * CHUNK * config().cost.prefill_s_per_token
    copy_s = config().cost.copy_seconds(10 * CHUNK_BYTES, "host")
    assert copy_s < 0.0002
    for ask, waits in ((prefill_end + 0.0002, True), (prefill_end + 0.01, False)):
        result = replicas([seg(0.0, DOC), seg(ask, DOC, ("question", 16))])
        a, b = result.rows
        assert a.ttft_mean_s == pytest.approx(prefill_end)
        assert b.kvoffload_hit_tokens == 10 * CHUNK
        assert result.total.deferrals.get("pending", 0) == (1 if waits else 0)
        if waits:  # its first token comes after A's report
            assert ask + b.ttft_mean_s > prefill_end + 3 * config().cost.decode_s_per_token


def test_a_chunk_stored_by_two_replicas_at_once_is_stored_once_and_counted() -> None:
    # B does not wait for A's store (the deferral bound expires at once): it computes
    # the document itself while A's copy is in flight, and offers the same chunks.
    trace = [seg(0.0, DOC), seg(0.001, DOC), seg(10.0, DOC), seg(10.0, DOC)]
    settings = {"max_deferral_seconds": 1e-9}
    shared = replicas(trace, **settings)
    private = replicas(trace, shared=False, **settings)
    assert shared.rows[1].kvoffload_hit_tokens == 0  # B computed it
    assert shared.total.tier("host").written == 10  # type: ignore[union-attr]
    assert shared.spared_storing + shared.spared_present == 10  # once, not per offer
    assert shared.rows[1].stores_spared == 10 and shared.rows[0].stores_spared == 0
    assert shared.distinct_at_end == 10 and shared.extra_copies_max == 0
    assert private.total.tier("host").written == 20  # type: ignore[union-attr]
    assert private.extra_copies_max == private.extra_copies_at_end == 10


def test_memory_shared_holds_one_copy_where_private_tiers_hold_one_each() -> None:
    # Four replicas each get the document, well apart: private tiers hold four copies.
    trace = [seg(float(10 * i), DOC, (f"q{i}", 16)) for i in range(4)]
    shared = replicas(trace, n=4)
    private = replicas(trace, n=4, shared=False)
    assert shared.peak_used_chunks == 10 and shared.extra_copies_max == 0
    assert private.peak_used_chunks == 40 and private.extra_copies_max == 30
    assert private.host_capacity_chunks == shared.host_capacity_chunks == 1024
    assert [row.kvoffload_hit_tokens for row in shared.rows] == [0, *[10 * CHUNK] * 3]
    assert shared.as_json()["replicas"]["host_peak_used_bytes"] == 10 * CHUNK_BYTES
    text = format_replicas(private)
    assert "4 private host tiers" in text and "at most 30 chunks (960KiB)" in text


def test_the_private_tiers_split_the_host_memory() -> None:
    # 40 chunks in all: each of four private tiers holds 10 of its document's 12.
    trace = [seg(float(10 * i), (f"doc{i}", 12 * CHUNK)) for i in range(4)]
    private = replicas(trace, n=4, shared=False, cpu_bytes=40 * CHUNK_BYTES)
    host = private.total.tier("host")
    assert host is not None and private.host_capacity_chunks == host.capacity_chunks == 40
    assert (host.written, host.evictions, host.held_at_end) == (48, 8, 40)
    assert private.peak_used_chunks == 40 and private.extra_copies_max == 0


def test_host_ledger_counts_copies_across_directories() -> None:
    keys = [ChunkKey(bytes([i]) * 16) for i in range(3)]
    one, two = Directory(4), Directory(4)
    ledger = HostLedger([one, two])
    for directory, stored in ((one, keys), (two, keys[:2])):
        directory.complete_store(directory.prepare_store(stored).keys, True)
    ledger.observe()
    assert (ledger.extra, ledger.distinct, ledger.peak_used_slots) == (2, 3, 5)
    two.discard(keys[:1])
    ledger.observe()
    assert (ledger.extra, ledger.peak_extra, ledger.distinct) == (1, 2, 3)


def test_round_robin_and_sticky_routing() -> None:
    turns = list(chat(users=3, concurrent=3).requests())
    spread = Router(ReplicaSetup(2))
    assert [spread.assign(r, i) for i, r in enumerate(turns[:4])] == [0, 1, 0, 1]
    sticky = Router(ReplicaSetup(2, route="sticky"))
    placed = [sticky.assign(r, i) for i, r in enumerate(turns)]
    by_user: dict[str, set[int]] = {}
    for request, replica in zip(turns, placed, strict=True):
        by_user.setdefault(request.segments[1][0].split("m")[0], set()).add(replica)
    assert by_user == {"u0": {0}, "u1": {1}, "u2": {0}}


def test_bad_setups_are_refused() -> None:
    with pytest.raises(UsageError, match="--replicas"):
        ReplicaSetup(0)
    with pytest.raises(UsageError, match="--route"):
        ReplicaSetup(2, route="random")
    with pytest.raises(UsageError, match="lower tiers"):
        replicas([seg(0.0, DOC)], tier_bytes={"disk": 64 * CHUNK_BYTES})


SMALL = ["--users", "12", "--turns", "3", "--concurrent-users", "5", "--no-progress"]
SMALL = [*SMALL, "--engine-tokens", "4096", "--cpu-bytes", "2GiB"]


def _run(capsys: pytest.CaptureFixture[str], *extra: str) -> tuple[list[str], dict[str, Any]]:
    assert main([*SMALL, *extra, "--json"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    data.pop("wall_s")
    text = [line for line in captured.err.splitlines() if not line.startswith("(simulated in")]
    return text, data


def test_the_command_with_one_replica_prints_todays_report(
    capsys: pytest.CaptureFixture[str],
) -> None:
    today = _run(capsys)
    assert today[1]["requests"] == 36 and "Replicas" not in "\n".join(today[0])
    assert _run(capsys, "--replicas", "1") == today
    assert _run(capsys, "--replicas", "1", "--host-share", "--route", "sticky") == today


def test_the_command_reports_replicas_and_host_memory(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text, data = _run(capsys, "--replicas", "3", "--host-share")
    joined = "\n".join(text)
    assert "Replicas: 3, one shared host tier of 2GiB in all, round-robin routing" in joined
    assert "stores spared" in joined and "used at peak" in joined
    assert data["requests"] == 36 and len(data["replicas"]["per_replica"]) == 3
    assert sum(row["requests"] for row in data["replicas"]["per_replica"]) == 36
    assert data["replicas"]["host_capacity_bytes"] <= 2 * 2**30
    _, private = _run(capsys, "--replicas", "2")  # 1GiB each: the same 2GiB in all
    assert private["replicas"]["host_share"] is False
    assert private["replicas"]["host_capacity_bytes"] == data["replicas"]["host_capacity_bytes"]
    with pytest.raises(UsageError, match="--sweep"):
        main([*SMALL, "--replicas", "2", "--sweep", "1GiB"])
