"""Every option's default is read from its declaration (``default(name)``), and host
slots are computed in one place (``core/config/capacity.py``)."""

from __future__ import annotations

import dataclasses

import pytest

from kvoffload.core.config import own_options
from kvoffload.core.config.capacity import host_slots, slots_per_rank
from kvoffload.core.config.options import OPTIONS, default, option
from kvoffload.core.config.typed import OffloadConfig
from kvoffload.core.errors import ConfigError


def test_default_is_the_declared_one_for_every_option() -> None:
    for declared in OPTIONS:
        assert option(declared.name) is declared
        assert default(declared.name) == declared.default


def test_own_options_answer_as_options_do() -> None:
    for declared in own_options.OWN_OPTIONS:
        assert own_options.option(declared.name) is option(declared.name)
        assert own_options.default(declared.name) == default(declared.name)


def test_an_unknown_name_is_a_config_error_naming_it() -> None:
    with pytest.raises(ConfigError, match="'no_such_option': unknown option"):
        default("no_such_option")
    with pytest.raises(ConfigError, match="'disk_path': unknown option"):
        own_options.default("disk_path")  # a tier's option, not kvoffload's own


def test_offload_config_fields_default_to_the_declared_defaults() -> None:
    for f in dataclasses.fields(OffloadConfig):
        if f.name not in ("cpu_bytes", "tier_options"):
            assert f.default == default(f.name), f.name


@pytest.mark.parametrize(
    ("cpu_bytes", "chunk_bytes", "world_size", "slots"),
    [
        (100, 10, 1, 10),
        (100, 10, 2, 5),
        (99, 10, 2, 4),
        (105, 10, 4, 2),
        (9, 10, 1, 0),
        (5, 0, 1, 0),
    ],
)
def test_slots_per_rank(cpu_bytes: int, chunk_bytes: int, world_size: int, slots: int) -> None:
    assert slots_per_rank(cpu_bytes, chunk_bytes, world_size) == slots
    assert slots_per_rank(cpu_bytes, chunk_bytes, world_size) == (
        cpu_bytes // (chunk_bytes * world_size) if chunk_bytes else 0
    )


def test_host_slots_raises_naming_cpu_bytes_when_no_chunk_fits() -> None:
    assert host_slots(100, 10, 2) == 5
    with pytest.raises(ConfigError, match="'cpu_bytes'.*at least one chunk per worker, 20 bytes"):
        host_slots(19, 10, 2)
