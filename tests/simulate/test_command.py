"""``kvoffload simulate`` end to end: help, the table, JSON, traces, sweeps, errors."""

from __future__ import annotations

import json
import subprocess
import sys
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


def mooncake_lines(requests: int, spacing_ms: int, prompt: int = 1000) -> str:
    """Users that each resend a shared 512-token block, their own growing history
    (one 512-token block a turn) and a partial last block."""
    lines = []
    for i in range(requests):
        user, turn = i % 4, i // 4
        full = [0] + [1000 * user + k for k in range(1, turn + 1)]
        size = 512 * len(full) + prompt % 512
        line = {"timestamp": spacing_ms * i, "input_length": size, "output_length": 4}
        lines.append(json.dumps({**line, "hash_ids": [*full, 100_000 + i]}) + "\n")
    return "".join(lines)


def test_a_mooncake_trace_runs_as_it_is_with_its_limits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "mooncake.jsonl"
    trace.write_text(mooncake_lines(24, 1000))
    out_json = tmp_path / "out.json"
    args = ["simulate", "--trace", str(trace), "--cpu-bytes", "50%", "--no-progress"]
    assert cli([*args, "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    data = json.loads(out_json.read_text())
    assert data["settings"]["chunk_tokens"] == 512  # matched to the trace's block
    # 24 distinct tails, 4 users' 5 history blocks, the shared block: 45 chunks
    assert data["optimum_capacity_chunks"] == 22
    assert data["settings"]["cpu_bytes"] == 22 * data["chunk_bytes"]
    assert data["total_hit_rate"] == pytest.approx(data["hit_rate"] + data["engine_hit_rate"])
    assert 0 < data["total_hit_rate"] <= data["optimum_hit_rate"] <= data["infinite_hit_rate"]
    assert data["share_of_optimum"] == pytest.approx(
        data["total_hit_rate"] / data["optimum_hit_rate"]
    )
    assert data["behind_trace"] is False and "WARNING" not in out
    assert "hit rate (engine + kvo)" in out and "limit                     optimum" in out
    assert cli([*args, "--head", "8", "--json", str(out_json)]) == 0
    assert json.loads(out_json.read_text())["requests"] == 8
    assert "(first 8 requests)" in capsys.readouterr().out


def test_an_engine_behind_its_trace_is_a_loud_warning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "fast.jsonl"
    trace.write_text(mooncake_lines(40, 100))  # 10 requests/s of 1000-token prompts
    out_json = tmp_path / "out.json"
    slow = ["--prefill-s-per-token", "0.01", "--no-progress", "--json", str(out_json)]
    assert cli(["simulate", "--trace", str(trace), *slow]) == 0  # 10 s per prompt
    out = capsys.readouterr().out
    assert json.loads(out_json.read_text())["behind_trace"] is True
    assert out.count("WARNING: the simulated engine fell behind the trace") == 2
    assert cli(["simulate", "--trace", str(trace), "--time-scale", "300", *slow]) == 0
    assert "WARNING" not in capsys.readouterr().out
    assert json.loads(out_json.read_text())["behind_trace"] is False


def test_a_sweep_in_shares_shows_engine_and_kvoffload_hits_and_the_limits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "mooncake.jsonl"
    trace.write_text(mooncake_lines(16, 1000))
    png = tmp_path / "chart.png"
    assert cli(["simulate", "--trace", str(trace), "--sweep", "10%,50%", "--jobs", "1",
                "--output", str(png), "--no-progress"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "hit rate (engine + kvoffload) by host memory and eviction policy"
    assert lines[2].split() == ["host", "memory", "arc", "lru", "s3fifo", "optimum", "infinite"]
    # 16 distinct tails, 4 users' 3 history blocks, the shared block: 29 chunks
    assert "(2 chunks)" in lines[3] and "(14 chunks)" in lines[4]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("option", [["--head", "3"], ["--time-scale", "2"]])
def test_trace_options_need_a_trace(option: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli(["simulate", *SMALL, *option]) == 2
    assert f"{option[0]}: needs --trace" in capsys.readouterr().err


def test_python_dash_m_kvoffload_is_the_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvoffload", "simulate", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.startswith("usage: kvoffload simulate")


def test_a_run_above_the_optimum_says_why(capsys: pytest.CaptureFixture[str]) -> None:
    # one chunk of host memory: the engine's prefix cache serves most hits
    assert cli(["simulate", *SMALL, "--engine-tokens", "4096", "--cpu-bytes", "1chunk"]) == 0
    out = capsys.readouterr().out
    assert "optimum" in out and "at 1 chunks" in out
    assert "(above it: the engine's own prefix cache adds capacity" in out
