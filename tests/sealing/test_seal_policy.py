"""Which tiers a configuration seals, what the start-up line says, and the refusals
(decision 0024)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload.core.config.typed import OffloadConfig
from kvoffload.core.errors import ConfigError
from kvoffload.sealing import policy
from kvoffload.sealing.keyfile import write_new
from kvoffload.sealing.layout import SEAL_BYTES
from kvoffload.tiers.build import kept_size, tier_slots
from kvoffload.tiers.registry import LOWER_TIERS

REDIS = {"redis_url": "redis://127.0.0.1:1"}
DISK = {"disk_path": "/nonexistent/kv", "disk_bytes": 1 << 30}


def config(**options: object) -> OffloadConfig:
    return OffloadConfig.from_dict({"cpu_bytes": 1 << 20, **options})


def test_without_a_key_the_start_up_line_says_redis_clients_are_trusted() -> None:
    line = policy.describe(config(**REDIS), LOWER_TIERS, None)
    assert "UNSEALED redis" in line and "every client of the store" in line
    assert policy.describe(config(**DISK), LOWER_TIERS, None) == ""  # a private disk


def test_seal_required_refuses_a_shared_store_without_a_key() -> None:
    with pytest.raises(ConfigError, match="seal_required") as exc:
        policy.settle(config(seal_required=True, **REDIS), LOWER_TIERS)
    assert "redis" in str(exc.value) and "seal-key new" in str(exc.value)
    assert policy.settle(config(seal_required=True, **DISK), LOWER_TIERS) is None


def test_with_a_key_redis_is_sealed_and_the_disk_only_when_asked(tmp_path: Path) -> None:
    key = tmp_path / "k"
    keys = write_new(key)
    both = config(seal_key_file=str(key), **REDIS, **DISK)
    sealed = {s.name for s in LOWER_TIERS if policy.sealed(both, s)}
    assert sealed == {"redis"}
    asked = config(seal_key_file=str(key), disk_seal=True, **REDIS, **DISK)
    assert {s.name for s in LOWER_TIERS if policy.sealed(asked, s)} == {"redis", "disk"}
    line = policy.describe(asked, LOWER_TIERS, policy.settle(asked, LOWER_TIERS))
    assert f"key {keys.ids()[0]}" in line and "UNSEALED" not in line


def test_a_sealed_tier_is_sized_for_sealed_chunks(tmp_path: Path) -> None:
    key = tmp_path / "k"
    write_new(key)
    plain = config(**DISK)
    sealed = config(seal_key_file=str(key), disk_seal=True, **DISK)
    disk = next(s for s in LOWER_TIERS if s.name == "disk")
    assert kept_size(sealed, disk, 4096) == 4096 + SEAL_BYTES
    assert kept_size(plain, disk, 4096) == 4096
    assert tier_slots(sealed, 1 << 20, 1)["disk"] < tier_slots(plain, 1 << 20, 1)["disk"]


def test_a_bad_key_file_fails_the_start_naming_the_option(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="seal_key_file"):
        policy.settle(config(seal_key_file=str(tmp_path / "none"), **REDIS), LOWER_TIERS)
