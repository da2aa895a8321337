"""Configuration: every key validated at start with an error naming it, and defaults
that match the documented table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvoffload.core.config.typed import OPTIONS, OffloadConfig
from kvoffload.core.errors import ConfigError
from kvoffload.tiers.redis_tier import password

BAD: dict[str, list[Any]] = {
    "cpu_bytes": [0, -1, "1GB", 1.5, True],
    "chunk_tokens": [0, "32", 2.0],
    "eviction": ["random", 1, None],
    "store_threshold": [0, "2"],
    "copy_threads": [0, 1.0],
    "tier_threads": [0, 2.5, True],
    "host_share": ["", "a/b", "../x", ".hidden", 5, "x" * 65],
    "host_share_timeout_ms": [0, -1, float("nan"), "5", True],
    "share_announce_ms": [-1, float("nan"), "250", True],
    "codec": ["zstd", "FP8", "", None, 8],
    "host_codec": ["zstd", "FP8", "", 8],
    "disk_codec": ["zstd", "Lossless", "", 8],
    "redis_codec": ["gzip", "", 0],
    "host_share_root": ["", 5, None],
    "host_share_group": ["", "no-such-group-kvoffload", -1, True, 3.5, 1 << 40],
    "disk_path": ["", 5],
    "disk_bytes": [0, -5, "1G"],
    "disk_o_direct": ["yes", 1],
    "disk_share": ["on", True, None],
    "redis_url": ["localhost:6379", "http://x", 6379],
    "redis_cluster": ["true", 0],
    "redis_timeout_ms": [0, 0.5, "100"],
    "tier_io_timeout_ms": [0, -1, 2.5, "5000", True],
    "redis_username": [1],
    "redis_password_file": ["", 5],
    "redis_password_env": ["", "A=B", 1],
    "redis_password": [b"pw"],
    "lower_tier_admission": ["sometimes", 0, -1, "3"],
    "lower_tier_loads": ["Direct", "", True, None],
    "load_policy": ["Cost", "never", True, None],
    "prefill_tokens_per_s": [0, -1, float("nan"), "1e4", True],
    "metrics_port": [0, 70000, "9400", True],
    "seal_key_file": ["", 5, True],
    "seal_required": ["yes", 1, None],
    "disk_seal": ["true", 0],
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
    if key.startswith("redis_password"):
        raw["redis_url"] = "redis://localhost:6379"
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


SECRET = "s3cr3t-value"


def test_no_repr_or_error_shows_a_password(tmp_path: Path) -> None:
    config = OffloadConfig.from_dict(
        {
            "cpu_bytes": 1,
            "redis_url": f"redis://user:{SECRET}@localhost:6379/0",
            "redis_password": SECRET,
        }
    )
    assert SECRET not in repr(config) and SECRET not in str(config)
    assert "redis://user:***@localhost:6379/0" in repr(config)
    assert config.inline_secret() == "redis_password"
    for bad in ({"redis_password": 5}, {"redis_url": f"http://u:{SECRET}@h"}):
        with pytest.raises(ConfigError) as caught:
            OffloadConfig.from_dict({"cpu_bytes": 1, "redis_url": "redis://h:1", **bad})
        assert SECRET not in str(caught.value)


def test_the_password_comes_from_a_file_or_an_environment_variable(tmp_path: Path) -> None:
    secret_file = tmp_path / "redis.pass"
    secret_file.write_text(SECRET + "\n")
    base = {"cpu_bytes": 1, "redis_url": "redis://localhost:6379"}
    from_file = OffloadConfig.from_dict({**base, "redis_password_file": str(secret_file)})
    assert password(from_file) == SECRET
    assert from_file.inline_secret() is None
    from_env = OffloadConfig.from_dict({**base, "redis_password_env": "KVO_TEST_PW"})
    assert password(from_env, {"KVO_TEST_PW": SECRET}) == SECRET
    with pytest.raises(ConfigError, match="KVO_TEST_PW is not set") as caught:
        password(from_env, {})
    assert caught.value.field == "redis_password_env"
    missing = OffloadConfig.from_dict({**base, "redis_password_file": str(tmp_path / "none")})
    with pytest.raises(ConfigError, match="cannot read") as caught:
        password(missing)
    assert caught.value.field == "redis_password_file"
    assert (
        OffloadConfig.from_dict({**base, "redis_url": f"redis://:{SECRET}@h:1"}).inline_secret()
        == "redis_url"
    )


@pytest.mark.parametrize(
    "raw",
    [
        {"redis_password_file": "/f", "redis_password_env": "X"},
        {"redis_password_env": "X", "redis_password": "p"},
    ],
)
def test_one_password_source_at_a_time(raw: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match="one way"):
        OffloadConfig.from_dict({"cpu_bytes": 1, "redis_url": "redis://h:1", **raw})


def test_a_password_without_redis_is_refused() -> None:
    with pytest.raises(ConfigError, match="needs redis_url"):
        OffloadConfig.from_dict({"cpu_bytes": 1, "redis_password_env": "X"})
