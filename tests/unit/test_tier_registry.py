"""The tier registry and the build module: what every spec declares, that importing
the registry costs nothing, and that opening tiers is all or nothing."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
from tests.unit.test_scheduler import NS

from kvoffload.core.config.typed import OPTIONS, OffloadConfig
from kvoffload.core.errors import ConfigError
from kvoffload.core.request_controls import TIER_NAMES
from kvoffload.core.tiering.lower import DirectoryTier
from kvoffload.tiers import build
from kvoffload.tiers.registry import (
    HOST,
    LOWER_TIERS,
    TIERS,
    lower_tier_names,
    tier_names,
    tier_spec,
)
from kvoffload.tiers.spec import OpenedIndex, TierContext


def test_the_registry_lists_each_tier_once_in_order() -> None:
    assert tier_names() == ("host", "disk", "redis") and TIERS[0] is HOST
    assert lower_tier_names() == ("disk", "redis") and TIERS[1:] == LOWER_TIERS
    assert tier_spec("redis").name == "redis"
    with pytest.raises(ConfigError, match="unknown tier 'tape'; known: host, disk, redis"):
        tier_spec("tape")
    assert TIER_NAMES == ("host", "disk", "redis")  # what a request's load_tiers accepts


def test_each_tier_owns_its_options_under_its_name() -> None:
    names = [o.name for o in OPTIONS]
    assert len(names) == len(set(names))
    assert HOST.section.options == ()  # host memory's options are the engine's own
    for spec in LOWER_TIERS:
        assert spec.section.options
        assert all(o.name.startswith(f"{spec.name}_") for o in spec.section.options)
        assert all(o.check(o.default) for o in spec.section.options)
        assert set(spec.section.options) <= set(OPTIONS)


def test_no_tier_is_on_by_default() -> None:
    config = OffloadConfig(cpu_bytes=1)
    assert build.enabled_tiers(config) == ()
    assert build.tier_slots(config, 4096, 1) == {}


def test_a_tier_is_on_when_its_options_say_so() -> None:
    config = OffloadConfig.from_dict(
        {"cpu_bytes": 1, "disk_path": "/nonexistent", "disk_bytes": 1 << 30}
    )
    assert [s.name for s in build.enabled_tiers(config)] == ["disk"]
    slots = build.tier_slots(config, 1 << 20, 2)
    assert 0 < slots["disk"] < (1 << 30) // (1 << 20) // 2  # each chunk file has a header
    with pytest.raises(ConfigError, match="disk_bytes"):
        build.tier_slots(config, 1 << 31, 1)  # not even one chunk fits


def test_importing_the_registry_imports_no_tier_dependency() -> None:
    code = (
        "import sys, kvoffload.core.config.typed, kvoffload.tiers.registry\n"
        "print(sorted(m for m in ('redis', 'numpy', 'torch', 'vllm') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


class _Closing:
    """An index whose ``close`` is recorded."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name = name
        self.log = log

    def opened(self) -> OpenedIndex[DirectoryTier]:
        return OpenedIndex(self, lambda: self.log.append(f"close {self.name}"))  # type: ignore[arg-type]


def test_a_tier_that_fails_to_open_closes_those_opened_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log: list[str] = []

    def refuse(config: object, ctx: TierContext) -> OpenedIndex[DirectoryTier]:
        raise ConfigError("second_path", "refused")

    first = replace(LOWER_TIERS[0], name="first", enabled=lambda c: True)
    first = replace(first, open_index=lambda c, ctx: _Closing("first", log).opened())
    second = replace(LOWER_TIERS[0], name="second", enabled=lambda c: True, open_index=refuse)
    monkeypatch.setattr(build, "LOWER_TIERS", (first, second))
    with pytest.raises(ConfigError, match="refused"):
        build.open_engine_tiers(
            OffloadConfig(cpu_bytes=1), NS, world_size=1, chunk_bytes=1, slots={"host": 4}
        )
    assert log == ["close first"]


def test_opened_tiers_close_once_last_first_and_can_be_replaced() -> None:
    log: list[str] = []
    tiers = build.LowerTiers([(LOWER_TIERS[0], _Closing("a", log).opened())])
    tiers.opened.append((LOWER_TIERS[1], _Closing("b", log).opened()))
    old = tiers.replace("redis", _Closing("c", log).opened())
    assert old.name == "b" and log == ["close b"]
    assert [i.name for i in tiers.indexes] == ["a", "c"]
    assert tiers.index("disk") is tiers.indexes[0] and tiers.index("tape") is None
    tiers.close()
    tiers.close()
    assert log == ["close b", "close c", "close a"]


def test_directory_tiers_come_in_the_registry_order() -> None:
    lower = build.directory_tiers({"redis": 4, "extra": 2, "disk": 8, "off": 0}, "lru")
    assert [t.name for t in lower] == ["disk", "redis", "extra"]
    assert all(isinstance(t, DirectoryTier) for t in lower)
    assert [t.directory.num_slots for t in lower] == [8, 4, 2]
