"""``kvoffload simulate`` end to end: help, the table, JSON, traces, sweeps, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvoffload.cli import main as cli
from kvoffload.simulate.command import main
from kvoffload.simulate.trace import read_trace

SMALL = ["--users", "12", "--turns", "3", "--concurrent-users", "6", "--no-progress"]
SMALL_ENGINE = ["--engine-tokens", "4096", "--cpu-bytes", "2GiB"]


def test_help_exits_zero_with_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kvoffload simulate")
    for option in ("--trace", "--sweep", "--cpu-bytes", "--prefill-s-per-token", "--json"):
        assert option in out


def test_a_small_run_prints_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["simulate", *SMALL, *SMALL_ENGINE]) == 0
    out = capsys.readouterr().out
    assert "Workload: chat: 12 users x 3 turns" in out
    assert "kvoffload hit rate" in out and "requests                  36" in out
    assert "Traffic" in out and "host" in out


def test_json_to_stdout_keeps_stdout_machine_readable(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli(["simulate", *SMALL, *SMALL_ENGINE, "--json"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert data["requests"] == 36
    assert 0 <= data["hit_rate"] <= 1
    assert data["tiers"][0]["tier"] == "host"
    assert "kvoffload hit rate" in captured.err  # the table went to stderr


def test_write_trace_then_replay_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "chat.jsonl"
    assert cli(["simulate", *SMALL, "--write-trace", str(trace)]) == 0
    assert "wrote 36 requests" in capsys.readouterr().out
    assert len(list(read_trace(str(trace)))) == 36
    out_json = tmp_path / "out.json"
    generated = tmp_path / "generated.json"
    assert cli(["simulate", *SMALL, *SMALL_ENGINE, "--json", str(generated)]) == 0
    assert cli(["simulate", "--trace", str(trace), *SMALL_ENGINE, "--json", str(out_json)]) == 0
    assert "trace " + str(trace) in capsys.readouterr().out
    # The trace is the generated workload: the same numbers.
    replayed, original = json.loads(out_json.read_text()), json.loads(generated.read_text())
    for key in ("requests", "prompt_tokens", "kvoffload_hit_tokens", "engine_hit_tokens"):
        assert replayed[key] == original[key]


def test_a_bad_trace_line_is_one_line_naming_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"t": 0, "prompt": [1, 2], "output": 1}\n{"t": 1, "output": 1}\n')
    assert cli(["simulate", "--trace", str(trace), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"kvoffload simulate: error: {trace}:2: give exactly one of")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--cpu-bytes", "lots"], "--cpu-bytes: 'lots' is not a size"),
        (["--users", "many"], "argument --users: invalid int value"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--eviction", "fifo"], "'eviction': invalid value 'fifo'; accepted: arc | lru | s3fifo"),
        (["--user-tokens", "5"], "--user-tokens: expected MIN,MAX"),
        (["--users", "0"], "--users: invalid value"),
        (["--lower-tier-admission", "x"], "--lower-tier-admission: expected write_through"),
        (["--engine-tokens", "1024"], "raise --engine-tokens"),
        (["--trace", "/nonexistent/t.jsonl"], "cannot read trace /nonexistent/t.jsonl"),
        (["--sweep", "1GiB,,x"], "--sweep: 'x' is not a size"),
        (["--prefill-s-per-token", "0"], "--prefill-s-per-token: must be a number > 0"),
    ],
)
def test_errors_are_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli(["simulate", *SMALL, *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert message in err


def test_sweep_writes_a_png_and_a_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "chart.png"
    sizes = "64MiB,256MiB,1GiB"
    assert cli(["simulate", *SMALL, "--engine-tokens", "4096", "--sweep", sizes,
                "--output", str(png), "--jobs", "1"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "arc" in out and "lru" in out and "s3fifo" in out
    assert "64MiB" in out and "1GiB" in out and f"wrote the chart to {png}" in out
