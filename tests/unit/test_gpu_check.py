"""``scripts/gpu-check``: its dry run needs nothing but torch and numpy, prints the JSON
line it promises, and really runs the round trips (and the fp8 codec's) on the CPU;
its measuring code runs (on the CPU, tiny); a wrong copy or decode fails it. The CUDA
paths themselves need a GPU."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

import pytest
import torch

from kvoffload.gpucheck import correctness, overlap, run, throughput
from kvoffload.gpucheck.report import Budget, Report
from kvoffload.transfer.cpu_copy import CpuCopier

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu-check"
KEYS = {
    "ok", "device", "torch", "cuda", "dry_run", "correctness", "throughput", "overlap",
    "codec", "skipped", "errors", "wall_s",
}  # fmt: skip
# kvoffload's own dependencies and extras, and what a GPU machine may lack: none may be
# needed. (torch itself tries dill and tqdm, optionally.)
BLOCKED = {
    "xxhash", "redis", "hiredis", "msgpack", "vllm", "transformers", "tokenizers",
    "huggingface_hub", "safetensors", "matplotlib", "tqdm", "dill", "prometheus_client",
    "yaml", "pytest", "hypothesis", "requests", "aiohttp", "pydantic", "psutil",
    "zstandard", "lz4", "blosc2", "triton", "cupy",
}  # fmt: skip
# Runs the script (argv[1]) as __main__ with every BLOCKED import failing; reports
# on stderr where kvoffload came from.
WRAPPER = f"""
import importlib.abc, runpy, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {sorted(BLOCKED)!r}:
            raise ModuleNotFoundError("blocked: " + name, name=name)
        return None
sys.meta_path.insert(0, Block())
sys.argv = sys.argv[1:]
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    print("KVOFFLOAD-FROM", sys.modules["kvoffload"].__file__, file=sys.stderr)
"""


def test_the_dry_run_needs_only_torch_and_numpy_and_prints_its_json_line() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [sys.executable, "-c", WRAPPER, str(SCRIPT), "--dry-run"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"KVOFFLOAD-FROM {ROOT / 'src'}" in out.stderr  # the script's own src/
    report = json.loads(out.stdout.splitlines()[-1])
    assert set(report) == KEYS
    assert report["ok"] is True and report["dry_run"] is True and report["errors"] == []
    assert report["throughput"] == [] and report["overlap"] is None
    skipped = {s.split(":")[0] for s in report["skipped"]}
    assert skipped == {"correctness", "codec", "throughput", "overlap"}
    assert any(s.startswith("correctness:cuda:") for s in report["skipped"])
    assert any(s.startswith("codec:cuda:") for s in report["skipped"])
    coded = report["codec"]  # fp8 on the CPU copy path: every dtype, within the bound
    assert [e["dtype"] for e in coded] == ["bfloat16", "float16", "float32"]
    assert all(e["ok"] and e["device"] == "cpu" for e in coded)
    assert [round(e["slot_ratio"]) for e in coded] == [2, 2, 4]
    ran = report["correctness"]
    assert len(ran) >= 48
    assert all(e["ok"] and e["device"] == "cpu" and e["bytes"] > 0 for e in ran)
    assert {e["slab"] for e in ran} == {"host", "shared"}
    assert {e["dtype"] for e in ran} == {"bfloat16", "float16", "float32"}
    assert {e["layout"] for e in ran} == set(correctness.LAYOUTS)


def test_an_fp8_decode_off_its_bound_fails_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvoffload.codecs import fp8
    from kvoffload.gpucheck import codec

    real = fp8.decode_batch

    def off(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = real(*args, **kwargs)
        return out.mul_(1.2)

    monkeypatch.setattr("kvoffload.transfer.cuda_codec_copy.decode_batch", off)
    monkeypatch.setattr(fp8, "decode_batch", off)
    entry = codec.run_case(torch.device("cpu"), torch.bfloat16, chunks=2, rounds=1)
    assert not entry["ok"] and "bound" in entry["error"]


def test_a_copy_that_drops_bytes_fails_the_check(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_load = CpuCopier.load

    def load_all_but_the_last_block(self: CpuCopier, plan: object) -> None:
        from kvoffload.transfer.plan import CopyPlan

        assert isinstance(plan, CopyPlan)
        n = len(plan.blocks) - 1
        cut = CopyPlan(plan.job, plan.rows[:n], plan.blocks[:n], plan.bounds.clip(0, n), 0)
        real_load(self, cut)

    monkeypatch.setattr(CpuCopier, "load", load_all_but_the_last_block)
    assert run.main(["--dry-run", "--quick"]) == 1
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert report["ok"] is False
    assert report["correctness"] and not any(e["ok"] for e in report["correctness"])
    assert all("differ" in e["error"] for e in report["correctness"])


def test_the_measurements_run_on_the_cpu() -> None:
    report = Report(dry_run=False)
    config = throughput.ThroughputConfig(
        round_bytes=1 << 20, rounds=2, job_bytes=256 << 10, chunk_sizes=(16 << 10, 64 << 10)
    )
    throughput.run_all(report, torch.device("cpu"), config, Budget.of(60))
    assert report.errors == []
    assert [(e["direction"], e["chunk_bytes"]) for e in report.throughput] == [
        ("store", 16 << 10),
        ("load", 16 << 10),
        ("store", 64 << 10),
        ("load", 64 << 10),
    ]
    assert all(e["ratio"] > 0 and e["rounds"] == 2 for e in report.throughput)
    small = overlap.OverlapConfig(
        n=32, dtype=torch.float32, target_s=0.02, rounds=1, engine_bytes=1 << 20, job_chunks=2,
        head_dim=8,
    )  # fmt: skip
    entry = overlap.run(torch.device("cpu"), small, Budget.of(60))
    assert entry["rounds"] == 1 and entry["slowdown"] > 0 and entry["copy_alone_gbps"] > 0


def test_a_spent_budget_skips_what_is_left() -> None:
    report = Report(dry_run=True)
    correctness.run_all(report, torch.device("cpu"), (16,), Budget.of(0))
    assert report.correctness == []
    assert report.skipped == ["correctness:cpu: time budget: 48 cases left"]
