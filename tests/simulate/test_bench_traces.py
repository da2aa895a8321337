"""``bench/traces.py``: every registered policy and the limits, as a table and a
chart, on a small Mooncake-style trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.bench_modules import bench_module

from kvoffload.core.policies import policy_names

traces = bench_module("traces")


def test_the_table_has_every_policy_and_the_limits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "mooncake.jsonl"
    lines = []
    for i in range(20):  # four users, a shared block, growing histories, unique tails
        full = [0] + [1000 * (i % 4) + k for k in range(1, i // 4 + 1)]
        line = {"timestamp": 1000 * i, "input_length": 512 * len(full) + 100}
        lines.append(json.dumps({**line, "output_length": 4, "hash_ids": [*full, 10_000 + i]}))
    trace.write_text("\n".join(lines) + "\n")
    png, out_json = tmp_path / "traces.png", tmp_path / "traces.json"
    args = ["--trace", str(trace), "--shares", "10,50", "--output", str(png)]
    assert traces.main([*args, "--json", str(out_json)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert "20 requests" in table[0] and "37 distinct chunks of 512 tokens" in table[0]
    assert table[2].split() == ["host", "capacity", "optimum", "infinite", *policy_names()]
    assert table[3].split()[:3] == ["10%", "(3", "chunks)"]
    assert table[4].split()[:3] == ["50%", "(18", "chunks)"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    points = json.loads(out_json.read_text())
    assert len(points) == 2 * len(policy_names())
