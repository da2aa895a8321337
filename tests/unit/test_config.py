"""Configuration: every key validated at start with an error naming it, and defaults
that match the documented table."""

from __future__ import annotations

from typing import Any

import pytest

from kvoffload.core.config import OPTIONS, OffloadConfig
from kvoffload.core.errors import ConfigError

BAD: dict[str, list[Any]] = {
    "cpu_bytes": [0, -1, "1GB", 1.5, True],
    "chunk_tokens": [0, "32", 2.0],
    "eviction": ["random", 1, None],
    "store_threshold": [0, "2"],
    "copy_threads": [0, 1.0],
    "tier_threads": [0, 2.5, True],
    "disk_path": ["", 5],
    "disk_bytes": [0, -5, "1G"],
    "disk_o_direct": ["yes", 1],
    "redis_url": ["localhost:6379", "http://x", 6379],
    "redis_cluster": ["true", 0],
    "redis_timeout_ms": [0, 0.5, "100"],
    "redis_username": [1],
    "redis_password": [b"pw"],
    "lower_tier_admission": ["sometimes", 0, -1, "3"],
    "metrics_port": [0, 70000, "9400", True],
    "max_deferral_steps": [0, 1.5],
    "max_deferral_seconds": [0, -1, float("nan"), float("inf"), "5"],
}


def test_every_option_has_bad_values_tested() -> None:
    assert set(BAD) == {o.name for o in OPTIONS}


@pytest.mark.parametrize(
    ("key", "value"), [(k, v) for k, values in BAD.items() for v in values], ids=repr
)
def test_a_bad_value_names_its_key_and_the_accepted_values(key: str, value: Any) -> None:
    raw: dict[str, Any] = {"cpu_bytes": 1 << 20, key: value}
    if key == "disk_path":
        raw["disk_bytes"] = 1 << 20
    if key == "disk_bytes":
        raw["disk_path"] = "/tmp/x"
    option = next(o for o in OPTIONS if o.name == key)
    with pytest.raises(ConfigError) as caught:
        OffloadConfig.from_dict(raw)
    message = str(caught.value)
    assert key in message and option.accepted in message


def test_defaults_are_the_documented_ones() -> None:
    config = OffloadConfig.from_dict({"cpu_bytes": 1})
    for option in OPTIONS:
        if not option.required:
            assert getattr(config, option.name) == option.default, option.name


def test_unknown_and_missing_keys() -> None:
    with pytest.raises(ConfigError, match="disk_pth.*valid keys"):
        OffloadConfig.from_dict({"cpu_bytes": 1, "disk_pth": "/x"})
    with pytest.raises(ConfigError, match="cpu_bytes.*required"):
        OffloadConfig.from_dict({})
    with pytest.raises(ConfigError, match="must be a mapping"):
        OffloadConfig.from_dict("cpu_bytes=1")  # type: ignore[arg-type]


def test_disk_path_and_disk_bytes_go_together() -> None:
    with pytest.raises(ConfigError, match="disk_bytes.*go together"):
        OffloadConfig.from_dict({"cpu_bytes": 1, "disk_path": "/x"})
    with pytest.raises(ConfigError, match="disk_path.*go together"):
        OffloadConfig.from_dict({"cpu_bytes": 1, "disk_bytes": 10})


def test_lower_tier_admission_values() -> None:
    assert OffloadConfig.from_dict({"cpu_bytes": 1}).spill_after_hits == 0
    config = OffloadConfig.from_dict({"cpu_bytes": 1, "lower_tier_admission": 3})
    assert config.spill_after_hits == 3
