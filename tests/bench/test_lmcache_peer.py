"""The LMCache peer of the e2e "tiers" benchmark without LMCache: the job and result
files, the server's command line, the readiness poll, the metrics parsing, the venv
recipe's bookkeeping, the runner's subprocess contract (a fake interpreter), the
benchmark's configurations and report rows (``bench/lmcache_peer.py``,
``bench/lmcache_env.py``, ``bench/lmcache_runner.py``, ``bench/e2e_tiers*.py``)."""

from __future__ import annotations

import importlib.util
import json
import stat
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from tests.bench_modules import bench_module

from kvoffload.demos.vllm_runner import EngineSpec, RequestResult, RunResult
from kvoffload.workload.chat import ChatWorkload

BENCH = Path(__file__).resolve().parents[2] / "bench"


peer = bench_module("lmcache_peer")
lmcache_env = bench_module("lmcache_env")
runner = bench_module("lmcache_runner")
e2e_tiers = bench_module("e2e_tiers")
e2e_tiers_report = bench_module("e2e_tiers_report")


class Prompt:
    def __init__(self, prompt: tuple[int, ...], output_tokens: int) -> None:
        self.prompt = prompt
        self.output_tokens = output_tokens


def a_spec() -> EngineSpec:
    return EngineSpec(
        model=Path("/models/tiny"),
        kv_cache_memory_bytes=123456,
        block_size=32,
        max_model_len=640,
        max_num_seqs=4,
        kv_transfer_config={"kv_connector": "ignored"},
    )


def test_the_job_round_trips_through_json_with_lmcache_s_connector() -> None:
    batches = [[Prompt((1, 2, 3), 4), Prompt((5,), 2)], [Prompt((1, 2, 3, 9), 4)]]
    job = json.loads(json.dumps(peer.job(a_spec(), batches, 1000, Path("/tmp/l2"), 32)))
    assert (job["l1_bytes"], job["l2_dir"], job["chunk_tokens"]) == (1000, "/tmp/l2", 32)
    assert "kv_transfer_config" not in job["engine"]
    spec = peer.engine_spec(job, peer.connector_config(5600))
    assert replace(spec, kv_transfer_config=None) == replace(a_spec(), kv_transfer_config=None)
    assert spec.kv_transfer_config == {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.mp.host": "tcp://127.0.0.1",
            "lmcache.mp.port": 5600,
        },
    }
    got = [[(p.prompt, p.output_tokens) for p in b] for b in peer.job_batches(job)]
    assert got == [[((1, 2, 3), 4), ((5,), 2)], [((1, 2, 3, 9), 4)]]
    assert peer.job(a_spec(), batches, 1000, None, 32)["l2_dir"] is None


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_the_server_command_sizes_l1_in_gib_and_adds_the_fs_l2_when_asked() -> None:
    l1 = 25_016_320  # not a whole number of GiB
    cmd = peer.server_command(
        "/v/bin/lmcache", 5600, 8081, l1_bytes=l1, chunk_tokens=32, l2_dir=None
    )
    assert cmd[:2] == ["/v/bin/lmcache", "server"]
    assert _flag(cmd, "--host") == _flag(cmd, "--http-host") == "127.0.0.1"
    assert (_flag(cmd, "--port"), _flag(cmd, "--http-port")) == ("5600", "8081")
    assert _flag(cmd, "--supported-transfer-mode") == "auto"
    assert _flag(cmd, "--chunk-size") == "32"
    assert _flag(cmd, "--eviction-policy") == "LRU"
    # LMCache computes int(size_gb * 2**30): the same bytes back.
    assert int(float(_flag(cmd, "--l1-size-gb")) * (1 << 30)) in (l1, l1 - 1)
    assert "--l2-adapter" not in cmd
    disk = peer.server_command("lmcache", 1, 2, l1_bytes=l1, chunk_tokens=32, l2_dir="/d/l2")
    assert json.loads(_flag(disk, "--l2-adapter")) == {"type": "fs", "base_path": "/d/l2"}


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def test_wait_ready_polls_until_the_probe_answers() -> None:
    clock, answers = FakeClock(), iter([False, False, True])
    waited = peer.wait_ready(
        lambda: next(answers), lambda: True, 10.0, interval_s=0.5, clock=clock, sleep=clock.sleep
    )
    assert clock.sleeps == [0.5, 0.5] and waited == 1.0


def test_wait_ready_gives_up_when_the_server_exits_or_the_time_is_out() -> None:
    clock = FakeClock()
    with pytest.raises(peer.PeerFailed, match="exited"):
        peer.wait_ready(lambda: False, lambda: False, 10.0, clock=clock, sleep=clock.sleep)
    assert clock.sleeps == []
    with pytest.raises(peer.PeerFailed, match="not ready after 3 s"):
        peer.wait_ready(
            lambda: False, lambda: True, 3.0, interval_s=1.0, clock=clock, sleep=clock.sleep
        )
    assert clock.sleeps == [1.0, 1.0, 1.0]


def test_counters_are_summed_over_labels_and_differenced() -> None:
    text = "\n".join(
        [
            "# HELP lmcache_mp_lookup_hit_l1_tokens_total tokens",
            "# TYPE lmcache_mp_lookup_hit_l1_tokens_total counter",
            'lmcache_mp_lookup_hit_l1_tokens_total{cache_salt=""} 96.0',
            'lmcache_mp_lookup_hit_l1_tokens_total{cache_salt="a"} 32.0',
            'lmcache_mp_lookup_hit_l1_tokens_created{cache_salt=""} 1.7e9',
            "lmcache_mp_l1_usage_bytes 4096",
            "lmcache_mp_l1_write_chunks_total 7",
            "broken_total not-a-number",
        ]
    )
    after = peer.parse_metrics(text)
    assert after == {"lmcache_mp_lookup_hit_l1_tokens": 128.0, "lmcache_mp_l1_write_chunks": 7.0}
    before = {"lmcache_mp_l1_write_chunks": 2.0}
    assert peer.grown(before, after) == {
        "lmcache_mp_lookup_hit_l1_tokens": 128.0,
        "lmcache_mp_l1_write_chunks": 5.0,
    }


def a_result() -> RunResult:
    requests = (
        RequestResult(0, 0, 300, 4, 0.25, 96, 0, (5, 6, 7, 8)),
        RequestResult(1, 0, 340, 4, 0.125, 288, 1, (9, 9, 9, 9)),
    )
    return RunResult(requests, 3.5, 96, 288)


def test_the_result_round_trips_through_json() -> None:
    data = json.loads(json.dumps(peer.result_json(a_result(), {"x": 3.0})))
    assert peer.parse_result(data) == (a_result(), {"x": 3.0})


def _fake_python(tmp_path: Path, body: str) -> Path:
    """An executable standing in for LMCache's python: ``$1`` is the runner, ``$2`` the
    job, ``$3`` the result file."""
    path = tmp_path / "python"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return path


def test_run_peer_reads_the_runner_s_result(tmp_path: Path) -> None:
    (tmp_path / "result.json").write_text(json.dumps(peer.result_json(a_result(), {"y": 1.0})))
    body = f'test -f "$2" && cat {tmp_path / "result.json"} > "$3"'
    python = _fake_python(tmp_path, body)
    assert peer.run_peer(python, {"j": 1}, tmp_path / "w") == (a_result(), {"y": 1.0})
    assert json.loads((tmp_path / "w" / "job.json").read_text()) == {"j": 1}


def test_run_peer_reports_the_runner_s_last_line(tmp_path: Path) -> None:
    python = _fake_python(tmp_path, 'echo starting; echo "failed: no server"; exit 1')
    with pytest.raises(peer.PeerFailed, match=r"runner exit 1: failed: no server$"):
        peer.run_peer(python, {}, tmp_path / "w")


def test_run_peer_gives_the_runner_kvoffload_s_sources_only() -> None:
    env = peer.runner_env({"PYTHONPATH": "/elsewhere", "VIRTUAL_ENV": "/v", "HOME": "/h"})
    src, bench = env["PYTHONPATH"].split(":")
    assert Path(src) == peer.REPO / "src" and Path(bench) == BENCH
    assert "VIRTUAL_ENV" not in env and env["HOME"] == "/h"


def test_kvoffload_s_vllm_plugin_is_left_out_of_lmcache_s_engine() -> None:
    others = [("lora", "vllm.plugins.lora:register"), ("x", "other_pkg.plugin:go")]
    assert peer.allowed_plugins(others) is None  # nothing to leave out: VLLM_PLUGINS unset
    ours = [*others, ("kvoffload", "kvoffload.adapters.vllm.plugin:register")]
    assert peer.allowed_plugins(ours) == "lora,x"
    assert peer.allowed_plugins([("kvoffload", "kvoffload.adapters.vllm.plugin:register")]) == ""


def test_the_lmcache_install_s_downgrades_are_put_back() -> None:
    before = lmcache_env.parse_freeze("numpy==2.3.5\nprotobuf==7.36.2\nTorch==2.13.0+cpu\n")
    after = lmcache_env.parse_freeze(
        "numpy==2.2.6\nprotobuf==6.33.6\ntorch==2.13.0+cpu\nlmcache==0.5.6\n-e /x\n"
    )
    assert before == {"numpy": "2.3.5", "protobuf": "7.36.2", "torch": "2.13.0+cpu"}
    assert lmcache_env.restorations(before, after) == ["numpy==2.3.5", "protobuf==7.36.2"]


def test_the_venv_is_ready_only_with_this_recipe_s_marker(tmp_path: Path) -> None:
    assert not lmcache_env.is_ready(tmp_path)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").write_text("")
    assert not lmcache_env.is_ready(tmp_path)
    (tmp_path / lmcache_env.MARKER).write_text("an older recipe\n")
    assert not lmcache_env.is_ready(tmp_path)
    (tmp_path / lmcache_env.MARKER).write_text(lmcache_env.recipe_hash() + "\n")
    assert lmcache_env.is_ready(tmp_path)
    assert lmcache_env.ensure(tmp_path) == tmp_path / "bin" / "python"  # no install


def test_the_llvmlite_loader_refuses_dunder_names() -> None:
    """In a child process: llvmlite imported into the test process makes every later
    vLLM CPU engine in it fail at start (feasibility.md section 11)."""
    if importlib.util.find_spec("llvmlite") is None:
        pytest.skip("llvmlite is not installed")
    check = f"""
import sys
sys.path.insert(0, {str(BENCH)!r})
import lmcache_runner as runner
from llvmlite.binding import ffi
runner.patch_llvmlite_loader()
runner.patch_llvmlite_loader()  # idempotent
assert not hasattr(ffi.lib, "__dict__")  # vars() of it raises instead of a C lookup
assert callable(ffi.lib.LLVMPY_GetVersionInfo)  # C functions are still found
"""
    done = subprocess.run(
        [sys.executable, "-c", check], check=False, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr


def tier_setup(tmp_path: Path, system: int) -> Any:
    workload = ChatWorkload(4, 2, system, (32, 32), 8, vocab=1000, seed=1)
    return e2e_tiers.TierSetup("tiny", workload, 1, tmp_path)


def test_lmcache_s_small_l1_holds_the_longest_request(tmp_path: Path) -> None:
    s = tier_setup(tmp_path, 64)
    chunks = -(-s.longest() // 32)
    assert s.host_small() < chunks * s.chunk_bytes  # 10% is too small here
    assert s.lmcache_l1("lmcache10+disk") == chunks * s.chunk_bytes
    assert s.lmcache_l1("lmcache") == s.host_big()
    big = e2e_tiers.TierSetup(
        "tiny", ChatWorkload(64, 2, 64, (32, 32), 8, vocab=1000, seed=1), 1, tmp_path
    )
    assert big.lmcache_l1("lmcache10+disk") == big.host_small()  # 10% suffices


def test_without_lmcache_s_venv_its_configs_fail_and_the_rest_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unavailable(venv: Path | None = None) -> Path:
        raise lmcache_env.Unavailable("pip install lmcache==0.5.6: no network")

    monkeypatch.setattr(lmcache_env, "ensure", unavailable)
    configs = ("never-evicting", "lmcache", "lmcache10+disk")
    res = e2e_tiers.Results(configs, {c: [] for c in configs})
    assert e2e_tiers.lmcache_python(res) is None
    assert res.failed == {
        c: "failed: LMCache's venv: pip install lmcache==0.5.6: no network" for c in configs[1:]
    }
    none = e2e_tiers.Results(("never-evicting",), {"never-evicting": []})
    assert e2e_tiers.lmcache_python(none) is None and not none.failed


def test_the_report_shows_lmcache_s_counters_and_ratio(tmp_path: Path) -> None:
    configs = ("never-evicting", "lmcache", "lmcache10+disk")
    res = e2e_tiers.Results(configs, {c: [] for c in configs})
    res.runs["never-evicting"] = [a_result(), a_result()]
    slower = RunResult(
        tuple(replace(r, ttft_s=2 * r.ttft_s) for r in a_result().requests), 4.0, 0, 96
    )
    res.runs["lmcache"] = [slower, slower]
    res.peer_counts = {"lmcache": [{"lmcache_mp_lookup_hit_l1_tokens": 10.0}, {}]}
    res.failed["lmcache10+disk"] = "failed: runner exit 1: boom"
    lines, ok = e2e_tiers_report.report(tier_setup(tmp_path, 64), res, simulate=False)
    row = next(line for line in lines if line.split()[:1] == ["lmcache"])
    assert "2.000x" in row and row.rstrip().endswith("2/2")
    assert any("lmcache10+disk" in line and "boom" in line for line in lines)
    l1 = next(line for line in lines if "of which L1" in line)
    assert l1.split()[-1] == "5"  # median of 10 and a run where it never counted (0)
    assert ok  # LMCache failing does not fail the benchmark


def test_no_lmcache_leaves_its_configs_out() -> None:
    e2e = bench_module("e2e")
    assert set(e2e_tiers.LMCACHE) <= e2e.parse_args(["--workload", "tiers"]).chosen
    chosen = e2e.parse_args(["--workload", "tiers", "--no-lmcache"]).chosen
    assert not set(e2e_tiers.LMCACHE) & chosen and "vllm-offload" in chosen
