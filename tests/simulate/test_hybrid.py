"""The simulator with several KV cache groups (a hybrid model): per-group block
tables in the engine, per-group chunks in kvoffload, and the report of both."""

from __future__ import annotations

import dataclasses
import json

import pytest
from sim_helpers import BYTES_PER_TOKEN, CHUNK, config, seg, simulate

from kvoffload.cli import main as cli
from kvoffload.core.errors import UsageError
from kvoffload.core.kv_groups import KVGroup, KVGroups
from kvoffload.simulate.cost import CostModel
from kvoffload.simulate.groups import describe, parse_kv_groups
from kvoffload.simulate.report import format_report
from kvoffload.simulate.trace import TraceRequest

FULL_WINDOW = KVGroups((KVGroup(), KVGroup(window=64)))  # block 16, chunk 32


def repeated(n: int = 20, tokens: int = 200) -> list[TraceRequest]:
    first = [seg(float(i), (f"p{i}", tokens)) for i in range(n)]
    return first + [dataclasses.replace(r, t=r.t + 1000) for r in first]


def test_kvoffload_stores_and_loads_one_chunk_per_group() -> None:
    result = simulate(repeated(), prefix_caching=False, kv_groups=FULL_WINDOW)
    g, host = result.groups, result.tier("host")
    assert g is not None and host is not None
    assert g.kinds == ["full", "window=64"]
    # First pass: each prompt's 6 full chunks (200 // 32), in both groups (a prompt is
    # computed in one step: the window still holds every chunk when it is stored).
    assert g.stored == [20 * 6, 20 * 6]
    # Second pass: the full group loads all 6; from 192 tokens the window (64) reads
    # tokens 129.. only: chunks 4 and 5.
    assert g.loaded == [20 * 6, 20 * 2]
    assert result.kvoffload_hit_tokens == 20 * 6 * CHUNK
    assert host.written == sum(g.stored) and host.read == sum(g.loaded)
    # Each group's chunk is half the model's bytes for its tokens.
    assert result.chunk_bytes == CHUNK * BYTES_PER_TOKEN // 2
    assert result.stored_bytes_per_token == BYTES_PER_TOKEN
    assert result.requests == 40 and result.engine_hit_tokens == 0


def test_the_engine_prefix_cache_hits_per_group() -> None:
    result = simulate(repeated(), engine_tokens=16384, kv_groups=FULL_WINDOW)
    # As with one group: the second pass hits 12 blocks (below the last prompt token)
    # in the engine; the window group kept the blocks its window reads.
    assert result.engine_hit_tokens == 20 * (200 // 16) * 16
    assert result.kvoffload_hit_tokens == 0


def test_window_groups_hold_fewer_blocks_so_longer_requests_fit() -> None:
    long = [seg(0.0, ("doc", 1400))]
    with pytest.raises(UsageError, match="more than the engine holds"):
        simulate(long, engine_tokens=1024)
    hybrid = config(engine_tokens=1024, kv_groups=FULL_WINDOW)
    # 1024 tokens of model KV = 128 blocks of half the layers, one the null block: a
    # request holds ceil(T / 16) full blocks and at most (63 + 512) // 16 + 2 = 37.
    assert hybrid.num_blocks == 128
    assert hybrid.request_capacity == 16 * (127 - 37)
    result = simulate(long, engine_tokens=1024, kv_groups=FULL_WINDOW)
    g = result.groups
    assert g is not None and result.requests == 1
    assert g.peak_context_tokens >= 1400 and g.peak_blocks <= 127
    window_only = config(engine_tokens=1024, kv_groups=KVGroups((KVGroup(window=64),)))
    assert window_only.request_capacity is None
    assert simulate([seg(0.0, ("doc", 5000))], engine_tokens=1024,
                    kv_groups=window_only.kv_groups).requests == 1  # fmt: skip


def test_a_chat_under_preemption_stays_consistent() -> None:
    groups = parse_kv_groups("full,2xwindow=64")
    requests = [seg(i * 0.001, ("sys", 96), (f"u{i}", 40 + i), output=24) for i in range(40)]
    result = simulate(requests, engine_tokens=768, cpu_bytes=64 * CHUNK * 1024, kv_groups=groups)
    g, host = result.groups, result.tier("host")
    assert g is not None and host is not None
    assert result.requests == 40 and result.preemptions > 0
    assert result.kvoffload_hit_tokens + result.engine_hit_tokens <= result.prompt_tokens
    assert host.written == sum(g.stored) and host.read == sum(g.loaded)
    assert g.stored[1] == g.stored[2] and g.loaded[1] == g.loaded[2]  # equal windows
    assert result.avoided_tokens <= g.loaded[0] * CHUNK  # a hit loads every full chunk


def test_the_report_shows_the_groups() -> None:
    result = simulate(repeated(4), prefix_caching=False, kv_groups=FULL_WINDOW)
    text = format_report(result)
    assert "kv groups    full,window=64: 2 groups" in text
    assert "chunks per group          stored full 24, window 24; loaded full 24, window 8" in text
    assert "host bytes per token      1024 B per stored token" in text
    data = result.as_json()
    assert data["groups"]["stored"] == [24, 24]
    assert data["settings"]["kv_groups"] == "full,window=64"


def test_one_group_results_have_no_group_fields() -> None:
    result = simulate(repeated(2))
    assert result.groups is None
    data = result.as_json()
    assert "groups" not in data and "kv_groups" not in data["settings"]
    assert "stored_bytes_per_token" not in data and "kv groups" not in format_report(result)


@pytest.mark.parametrize(
    ("text", "groups"),
    [
        ("full", "full"),
        ("full,5xwindow=1024", "full,5xwindow=1024"),
        ("window=4096", "window=4096"),
        (" window=8 , full ", "window=8,full"),
    ],
)
def test_kv_groups_parse(text: str, groups: str) -> None:
    assert describe(parse_kv_groups(text)) == groups


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("window=0", "--kv-groups: 'window=0': a window must be a positive token count"),
        ("window=-3", "--kv-groups: 'window=-3': a window must be a positive token count"),
        ("sliding", "--kv-groups: 'sliding' is not a KV cache group; expected full"),
        ("full,", "--kv-groups: '' is not a KV cache group"),
        ("0xfull", "--kv-groups: '0xfull': the count must be >= 1"),
        ("mamba", "is not a KV cache group"),
    ],
)
def test_bad_kv_groups_are_one_line_usage_errors(
    value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli(["simulate", "--users", "2", "--turns", "1", "--kv-groups", value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_the_command_runs_a_hybrid_model(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--users", "12", "--turns", "3", "--concurrent-users", "6",
            "--no-progress", "--engine-tokens", "4096", "--cpu-bytes", "2GiB",
            "--kv-groups", "full,5xwindow=1024", "--json"]  # fmt: skip
    assert cli(args) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["settings"]["kv_groups"] == "full,5xwindow=1024"
    assert len(data["groups"]["stored"]) == 6
    assert "chunks per group" in captured.err


def test_stores_read_live_blocks_of_their_group_and_fences_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Under preemption, with windows freeing blocks mid-request: every store reads
    consecutive blocks of one group's table of its request, no load names a block the
    window needs as NO_BLOCK, and no block handed out fresh in a step is still read by
    a store of an earlier step when the forward pass starts (the flush covered it)."""
    from kvoffload.core.jobs import NO_BLOCK, EngineJob, JobKind
    from kvoffload.simulate import runner
    from kvoffload.simulate.worker import SimWorker

    checked = {"stores": 0, "loads": 0, "fresh": 0}
    state: dict[str, object] = {}

    class CheckedWorker(SimWorker):
        def submit(self, job: object) -> None:
            sim = state["sim"]
            assert isinstance(sim, runner.Simulation) and sim.tables is not None
            if isinstance(job, EngineJob):
                req = sim.engine.requests.get(job.request_id)
                if req is not None and req.groups is not None:
                    k = job.blocks_per_chunk
                    for i in range(len(job.slots)):
                        blocks = job.block_ids[i * k : (i + 1) * k]
                        live = [b for b in blocks if b != NO_BLOCK]
                        g = sim.tables.group_of[live[0]]
                        table = req.groups.tables[g]
                        at = table.index(live[0])
                        if job.kind is JobKind.STORE:
                            assert tuple(table[at : at + k]) == blocks
                            checked["stores"] += 1
                        else:
                            assert all(sim.tables.group_of[b] == g for b in live)
                            checked["loads"] += 1
            super().submit(job)  # type: ignore[arg-type]

        def end_forward(self) -> None:
            fresh = state.pop("fresh", set())
            assert isinstance(fresh, set)
            start = self.clock.now + self.clock.stall_s
            for finish, _, job in self._heap:
                if job.kind is JobKind.STORE and finish > start and isinstance(job, EngineJob):
                    assert fresh.isdisjoint(job.block_ids), "a fresh block still being stored"
            checked["fresh"] += len(fresh)
            super().end_forward()

    monkeypatch.setattr(runner, "SimWorker", CheckedWorker)
    groups = parse_kv_groups("full,2xwindow=48")
    settings = config(engine_tokens=640, cpu_bytes=48 * CHUNK * 1024, kv_groups=groups,
                      token_budget=96, decode_stride=4, prefix_caching=False,
                      cost=CostModel(bytes_per_token=1024, host_gbps=0.002))  # fmt: skip
    sim = runner.Simulation(settings)
    state["sim"] = sim
    allocate = sim.pool.allocate

    def tracked(n: int) -> list[int] | None:
        out = allocate(n)
        fresh = state.setdefault("fresh", set())
        assert isinstance(fresh, set)
        fresh.update(out or ())
        return out

    monkeypatch.setattr(sim.pool, "allocate", tracked)
    requests = [seg(i * 1e-4, ("sys", 80), (f"u{i % 7}", 40), output=20) for i in range(60)]
    result = sim.run(requests, None)
    assert sim.scheduler is not None
    sim.scheduler.check_integrity()
    assert sim.scheduler.anomalies.counts == {}
    assert result.preemptions > 0 and result.kvoffload_hit_tokens > 0
    assert checked["stores"] > 0 and checked["loads"] > 0 and checked["fresh"] > 0
    assert result.flush_stall_s > 0  # stores are slow: fences had to flush some


def test_chunks_longer_than_a_window_are_noted(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--users", "4", "--turns", "2", "--no-progress", "--engine-tokens",
            "8192", "--kv-groups", "full,window=128"]  # fmt: skip
    assert cli(args) == 0
    err = capsys.readouterr().err
    assert "note: --chunk-tokens 256 exceeds the smallest window (128)" in err
