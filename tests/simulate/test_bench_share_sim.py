"""``bench/share_sim.py``: shared against private host tiers over 4 replicas, on a
small chat workload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.bench_modules import bench_module

share_sim = bench_module("share_sim")

SMALL = ["--users", "24", "--turns", "4", "--concurrent-users", "7", "--rate", "40"]


def test_the_table_has_three_runs_per_size_and_their_ratio(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "share.json"
    args = [*SMALL, "--engine-tokens", "4096", "--sizes", "1GiB,256MiB", "--match-limit", "2"]
    assert share_sim.main([*args, "--json", str(out_json)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("4 replicas, chat: 24 users x 4 turns, 7 open at once")
    sizes = [line.split()[0] for line in lines if " rr / " in line or " sticky/" in line]
    assert sizes == ["256MiB"] * 3 + ["1GiB"] * 3  # sorted, three runs each
    rows = json.loads(out_json.read_text())
    assert [row["size_bytes"] for row in rows] == [2**28, 2**30]
    for row in rows:
        ratio = row["shared_ttft_mean_s"] / row["private_ttft_mean_s"]
        assert row["ratio_shared_private"] == pytest.approx(ratio)
        assert row["shared_extra_copies_max_bytes"] == 0
        assert row["private_extra_copies_max_bytes"] > 0  # the system prompt, at least
        assert row["match_bytes"] in (row["size_bytes"], 2 * row["size_bytes"])
        assert row["match_reached"] == (row["match_hit_rate"] >= row["shared_total_hit_rate"])
    printed = [line for line in lines if line.strip().startswith("mean TTFT shared / private")]
    assert len(printed) == len(rows)
    for row, line in zip(rows, printed, strict=True):
        assert f"private {row['ratio_shared_private']:.2f}x" in line
