"""The generated parts of docs/usage.md match the code (config keys, metrics)."""

from __future__ import annotations

from kvoffload import docgen
from kvoffload.core.config.typed import OPTIONS
from kvoffload.core.observe.metrics import METRICS


def test_usage_md_is_up_to_date() -> None:
    text = docgen.USAGE.read_text()
    assert docgen.render(text) == text, "run: python -m kvoffload.docgen"


def test_every_option_and_metric_is_documented() -> None:
    text = docgen.USAGE.read_text()
    for option in OPTIONS:
        assert f"| `{option.name}` |" in text
    for metric in METRICS:
        assert f"| `{metric.full_name}` |" in text


def test_a_stale_block_is_detected() -> None:
    text = docgen.USAGE.read_text()
    stale = text.replace(f"| `{OPTIONS[0].name}` |", "| `renamed_key` |")
    assert docgen.render(stale) == text
