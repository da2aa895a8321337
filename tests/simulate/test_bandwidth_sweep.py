"""``kvoffload simulate --tier-bandwidth``: the simulator runs the scheduler half's own
load-or-recompute decision (decision 0013) on its timed lanes, so a sweep over the
lower tier's bandwidth shows where always loading stops paying and ``load_policy
cost`` does not follow it there."""

from __future__ import annotations

import json

import pytest

from kvoffload.cli import main as cli
from kvoffload.core.errors import UsageError
from kvoffload.simulate.bandwidth_sweep import parse_gbps_list

WORKLOAD = ["--users", "60", "--turns", "3", "--no-progress", "--jobs", "1"]
TIERED = ["--engine-tokens", "16384", "--cpu-bytes", "256MiB", "--disk-bytes", "64GiB"]


def test_a_slow_tier_is_recomputed_and_a_fast_one_loaded(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli(["simulate", *WORKLOAD, *TIERED, "--tier-bandwidth", "0.1,3", "--json"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out[out.index("{") :])
    base = data["without_kvoffload"]["ttft_mean_s"]
    ttft = {(p["tier_gbps"], p["load_policy"]): p["result"] for p in data["points"]}
    slow_always, slow_cost = ttft[(0.1, "always")], ttft[(0.1, "cost")]
    assert slow_always["ttft_mean_s"] > 10 * base  # the slow tier costs more than it saves
    assert slow_cost["ttft_mean_s"] < 1.2 * base  # cost recomputes instead
    assert sum(slow_cost["declined_tokens"].values()) > 0
    fast_always, fast_cost = ttft[(3.0, "always")], ttft[(3.0, "cost")]
    assert fast_cost["ttft_mean_s"] <= 1.02 * fast_always["ttft_mean_s"]  # no loss when fast
    assert fast_always["ttft_mean_s"] < base
    assert sum(fast_cost["declined_tokens"].values()) == 0


def test_the_load_policy_reaches_the_scheduler_half(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        cli(["simulate", *WORKLOAD, *TIERED, "--disk-gbps", "0.1", "--load-policy", "always"]) == 0
    )
    assert "load_policy always" in capsys.readouterr().out
    assert cli(["simulate", *WORKLOAD, *TIERED, "--load-policy", "never"]) != 0
    assert "'load_policy': invalid value 'never'" in capsys.readouterr().err


def test_bandwidths_are_checked() -> None:
    assert parse_gbps_list("3,0.5,3") == [0.5, 3.0]
    for bad in ("", "fast", "0", "-1"):
        with pytest.raises(UsageError, match="--tier-bandwidth"):
            parse_gbps_list(bad)
