"""``kvoffload codec-check`` on the tiny model (float32): both passes load what the
first stored (the report says how many tokens), the ``none`` control is exact in
float32, fp8 is reported against it with the model and sample it measured on (random
weights named); bad arguments are one-line errors. The comparison itself is checked on
hand-made answers (and in ``tests/unit/test_codec_check_report.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvoffload.cli import main as cli_main
from kvoffload.codec_check import Answer, compare, parse_bytes
from kvoffload.core.errors import UsageError

pytestmark = pytest.mark.slow


def test_compare_counts_agreement_and_deltas_before_the_first_difference() -> None:
    before = [Answer((1, 2, 3), (-0.1, -0.2, -0.3)), Answer((4, 5), (-1.0, -1.0))]
    after = [Answer((1, 2, 3), (-0.1, -0.25, -0.3)), Answer((4, 6), (-1.5, -2.0))]
    report = compare("fp8", before, after, 10)
    assert report.identical_requests == 1 and report.requests == 2
    assert report.token_agreement == pytest.approx(4 / 5)
    assert report.max_abs_logprob_delta == pytest.approx(0.5)  # (4 then 5|6: stops at 6)
    assert report.mean_abs_logprob_delta == pytest.approx((0 + 0.05 + 0 + 0.5) / 4)
    assert parse_bytes("64MiB", "x") == 64 << 20 and parse_bytes("1024", "x") == 1024
    with pytest.raises(UsageError, match="--cpu-bytes"):
        parse_bytes("lots", "--cpu-bytes")


def test_codec_check_on_the_tiny_model(
    tiny_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["codec-check", str(tiny_model), "--prompts", "4", "--prompt-tokens", "96",
            "--max-tokens", "8", "--kv-cache-memory-bytes", "4MiB", "--cpu-bytes", "32MiB",
            "--max-model-len", "256", "--json"]  # fmt: skip
    assert cli_main(argv) == 0
    out = capsys.readouterr().out  # vLLM logs to stdout too: the report is the last JSON
    none, fp8 = json.loads(out[out.rindex("[\n {") :])
    print(none, fp8)
    assert none["codec"] == "none" and fp8["codec"] == "fp8"
    assert none["loaded_tokens"] >= 4 * 64 and fp8["loaded_tokens"] >= 4 * 64  # really loaded
    assert none["identical_requests"] == 4 and none["max_abs_logprob_delta"] < 1e-4
    assert none["first_differences"] == [] and none["max_tokens"] == 8
    assert 0 <= fp8["token_agreement"] <= 1
    assert len(fp8["first_differences"]) == 4 - fp8["identical_requests"]
    sample = fp8["sample"]  # what was measured, on what
    assert (sample["prompts"], sample["prompt_tokens"], sample["max_tokens"]) == (4, "96", 8)
    assert sample["dtype"] == "float32" and "2 layers" in sample["architecture"]
    assert "'tiny'" in sample["random_weights"]  # the test model's weights are random


def test_codec_check_refuses_a_directory_without_a_model(tmp_path: Path) -> None:
    assert cli_main(["codec-check", str(tmp_path)]) == 2
