"""--sweep: every capacity x every policy, a table, and a PNG with a line per policy."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from sim_helpers import CHUNK_BYTES, config

from kvoffload.core.policies import policy_names
from kvoffload.simulate.chat import ChatTrace
from kvoffload.simulate.sweep import auto_sizes, format_sweep, plot_sweep, run_sweep, sweep_json
from kvoffload.workload.chat import ChatWorkload

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def workload() -> ChatTrace:
    shape = ChatWorkload(users=16, turns=4, system_tokens=64, output_tokens=16)
    return ChatTrace(dataclasses.replace(shape, user_tokens=(8, 40)), 8, 50.0)


def test_sweep_runs_every_size_and_policy_and_plots_one_line_per_policy(tmp_path: Path) -> None:
    sizes = [4 * CHUNK_BYTES, 16 * CHUNK_BYTES, 64 * CHUNK_BYTES]
    ticks: list[int] = []
    points = run_sweep(config(engine_tokens=512), workload(), sizes, progress=ticks.append)
    assert [(p.cpu_bytes, p.policy) for p in points] == [
        (s, name) for s in sizes for name in policy_names()
    ]
    assert sum(ticks) == len(points) == len(sizes) * len(policy_names())
    for name in policy_names():
        rates = [p.result.hit_rate for p in points if p.policy == name]
        assert rates[0] < rates[-1]  # more memory, more hits
    out = tmp_path / "sweep.png"
    assert plot_sweep(points, str(out), "test workload") == policy_names()
    assert out.read_bytes()[:8] == PNG_MAGIC
    table = format_sweep(points)
    assert len(table.splitlines()) == 2 + len(sizes)
    assert all(name in table.splitlines()[1] for name in policy_names())
    assert [p["policy"] for p in sweep_json(points)] == [p.policy for p in points]


def test_processes_give_the_same_results_as_one() -> None:
    sizes = [8 * CHUNK_BYTES]
    alone = run_sweep(config(engine_tokens=512), workload(), sizes, jobs=1)
    pooled = run_sweep(config(engine_tokens=512), workload(), sizes, jobs=2)
    assert [p.result.kvoffload_hit_tokens for p in alone] == [
        p.result.kvoffload_hit_tokens for p in pooled
    ]


def test_auto_sizes_double_up_to_the_working_set() -> None:
    gib = 2**30
    assert auto_sizes(100 * gib, 32 * 2**20) == [gib * 2**k for k in range(8)]
    assert auto_sizes(3 * 2**20, 2**20) == [2**20, 2**21, 2**22]  # none below one chunk
    assert auto_sizes(10, 2**20) == [2**20]
