"""The vLLM releases kvoffload runs on without being told (``adapters/vllm/versions.py``)."""

from __future__ import annotations

import pytest

from kvoffload.adapters.vllm.versions import (
    OVERRIDE,
    check_vllm_version,
    installed_vllm_version,
    version_problem,
)
from kvoffload.core.errors import ConfigError


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.33.0", "0.33.2rc1"])
def test_tested_releases_run(version: str) -> None:
    assert version_problem(version, {}) is None


@pytest.mark.parametrize("version", ["0.31.1", "0.34.0", "1.0.0", "dev", None])
def test_other_releases_are_refused_naming_the_range_and_the_override(
    version: str | None,
) -> None:
    problem = version_problem(version, {})
    assert isinstance(problem, ConfigError)
    text = str(problem)
    assert "0.32, 0.33" in text and f"{OVERRIDE}=1" in text
    assert version_problem(version, {OVERRIDE: "1"}) is None


def test_the_installed_vllm_is_a_tested_release() -> None:
    pytest.importorskip("vllm")
    assert version_problem(installed_vllm_version(), {}) is None
    check_vllm_version({})  # raises nothing here
