"""The simulator's prediction for the e2e "tiers" benchmark (``bench/e2e_sim.py``):
the trace is the benchmark's requests, turn by turn, and the predicted hits are
those worked out by hand; the table puts them next to measured runs. No engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.bench_modules import bench_module

from kvoffload.demos.vllm_runner import RequestResult, RunResult
from kvoffload.workload.chat import ChatWorkload

e2e_sim = bench_module("e2e_sim")
e2e_tiers = bench_module("e2e_tiers")
e2e_tiers_report = bench_module("e2e_tiers_report")


def setup(workload: ChatWorkload, tmp_path: Path) -> Any:
    return e2e_tiers.TierSetup("tiny", workload, 1, tmp_path)


def two_by_two() -> ChatWorkload:
    """2 users x 2 turns: 64-token system prompt, 40-token messages, 8-token answers."""
    return ChatWorkload(2, 2, 64, (40, 40), 8, vocab=1000, seed=1)


def test_the_trace_is_the_benchmark_s_requests_one_turn_after_another() -> None:
    w = ChatWorkload(3, 2, 64, (32, 48), 8, vocab=1000, seed=3)
    trace = e2e_sim.trace(w, gap_s=100.0)
    batches = [r for batch in e2e_sim.turn_batches(w.requests()) for r in batch]
    assert [t.prompt for t in trace] == [r.prompt for r in batches]
    assert [t.output for t in trace] == [8] * 6
    assert [t.t for t in trace] == [0.0] * 3 + [100.0] * 3
    assert all(not t.segments and t.output_id is None for t in trace)  # outputs: own content


def test_never_evicting_hits_are_the_shared_whole_blocks(tmp_path: Path) -> None:
    s = setup(two_by_two(), tmp_path)
    config = e2e_sim.sim_config(s, "never-evicting")
    assert (config.block_size, config.chunk_tokens, config.max_running) == (32, 32, 4)
    assert config.engine_tokens == s.big_tokens() - 32 and config.cpu_bytes == 0
    result = e2e_sim.predict(s, ["never-evicting"])["never-evicting"]
    # Turn 0: 64 + 40 = 104 tokens each; turn 1: 104 + 8 + 40 = 152.
    assert result.prompt_tokens == 2 * 104 + 2 * 152
    # Turn 0: no hit. Both users are prefilled in the first step and the simulator's
    # engine registers blocks once computed (vLLM registers them when it schedules
    # them: there user 1 would hit the 64-token system prompt of user 0).
    # Turn 1: the turn-0 prompt's whole blocks (3 of 32; the 4th holds the engine's own
    # answer, not the workload's), for each user.
    assert result.engine_hit_tokens == 2 * 96
    assert result.kvoffload_hit_tokens == 0


def test_a_small_engine_is_served_by_the_host_tier(tmp_path: Path) -> None:
    s = setup(ChatWorkload(16, 3, 64, (32, 64), 8, vocab=1000, seed=7), tmp_path)
    p = e2e_sim.predict(s)
    assert set(p) == {"never-evicting", "host-big", "host10+disk", "host10+redis", "no-offload"}
    assert p["no-offload"].engine_hit_tokens < p["never-evicting"].engine_hit_tokens
    assert p["host-big"].kvoffload_hit_tokens > 0
    assert p["no-offload"].kvoffload_hit_tokens == 0
    # Host memory of twice the working set recovers every hit the large engine has.
    host_big = p["host-big"].engine_hit_tokens + p["host-big"].kvoffload_hit_tokens
    assert host_big == p["never-evicting"].engine_hit_tokens
    c = e2e_sim.sim_config(s, "host10+disk")
    assert c.cpu_bytes == s.host_small() and 0 < c.tier_bytes["disk"] <= s.host_big()
    assert c.lower_tier_loads == "direct" and c.lower_tier_admission == "write_through"
    assert e2e_sim.sim_config(s, "host10+redis").tier_bytes["redis"] > s.host_big()


def _run(prompt_tokens: int, local: int, external: int) -> RunResult:
    request = RequestResult(0, 0, prompt_tokens, 8, 0.1, local + external, 0, ())
    return RunResult((request,), 1.0, local, external)


def test_the_table_compares_the_hit_rates(tmp_path: Path) -> None:
    s = setup(two_by_two(), tmp_path)
    configs = ("never-evicting", "no-offload", "host-big", "vllm-offload")
    res = e2e_tiers.Results(configs, {c: [] for c in configs})
    res.runs["never-evicting"] = [_run(512, 192, 0), _run(512, 200, 0), _run(512, 190, 0)]
    res.runs["no-offload"] = [_run(512, 300, 0)]  # far above the prediction
    res.failed["host-big"] = "failed: boom"
    lines = e2e_tiers_report.sim_lines(s, res)
    rows = {line.split()[0]: line for line in lines[2:-1]}
    assert set(rows) == set(configs)
    assert rows["never-evicting"].split()[1:] == [
        "192", "192", "0", "0", "37.5%", "37.5%", "1.000x", "PASS",
    ]  # fmt: skip
    assert rows["no-offload"].endswith("FAIL")
    assert "n/a" in rows["host-big"] and "boom" in rows["host-big"]
    assert "not simulated" in rows["vllm-offload"]
    assert "512 prompt tokens" in lines[-1] and "differ" not in lines[-1]
