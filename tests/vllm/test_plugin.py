"""kvoffload's vLLM plugin and start-up voice: the connector name registered, a bad
``kv_connector_extra_config`` refused before vLLM builds anything, kvoffload's log
records on vLLM's handlers, one summary per role, no password ever printed."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from kvoffload.adapters.vllm import plugin
from kvoffload.adapters.vllm.logs import ToVllmHandlers, attach_to_vllm_logging
from kvoffload.adapters.vllm.startup import scheduler_summary, warn_tiers
from kvoffload.core.config.typed import OffloadConfig
from kvoffload.core.errors import ConfigError
from kvoffload.tiers.redis_tier import probe

SECRET = "pl41n-s3cret"


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def lines(self) -> list[str]:
        return [r.getMessage() for r in self.records]


@pytest.fixture
def vllm_log() -> Iterator[Capture]:
    """A handler on vLLM's own logger: what reaches it is what vLLM prints."""
    capture = Capture()
    target = logging.getLogger("vllm")
    level = target.level
    target.setLevel(logging.INFO)  # as vLLM's logging configuration sets it
    ours = logging.getLogger("kvoffload")
    ours_level = ours.level
    ours.setLevel(logging.DEBUG)  # an earlier in-process fuzzer run may have quieted it
    target.addHandler(capture)
    yield capture
    target.removeHandler(capture)
    target.setLevel(level)
    ours.setLevel(ours_level)


def transfer(extra: Any, **more: Any) -> dict[str, Any]:
    return {
        "kv_connector": "KVOffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
        **more,
    }


def test_the_entry_point_is_installed_and_registers_the_connector_name() -> None:
    from importlib.metadata import entry_points

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.engine.arg_utils import EngineArgs

    (ours,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "kvoffload"]
    assert ours.load() is plugin.register
    plugin.register()
    plugin.register()  # idempotent: vLLM may call it again
    loader = KVConnectorFactory._registry["KVOffloadConnector"]
    from kvoffload.adapters.vllm.connector import KVOffloadConnector

    assert loader() is KVOffloadConnector
    assert getattr(EngineArgs.create_engine_config, "_kvoffload_checks_config", False)
    assert not getattr(
        EngineArgs.create_engine_config.__wrapped__, "_kvoffload_checks_config", False
    )  # wrapped once


def test_a_bad_config_is_refused_before_vllm_builds_its_configuration(
    vllm_log: Capture, tmp_path: Any
) -> None:
    from vllm.engine.arg_utils import EngineArgs

    plugin.register()
    args = EngineArgs(
        model=str(tmp_path / "no-such-model"),  # never read: the check comes first
        kv_transfer_config=transfer({"cpu_bytes": 1, "cpu_byte": 2}),  # type: ignore[arg-type]
    )
    with pytest.raises(ConfigError) as caught:
        args.create_engine_config()
    assert caught.value.field == "cpu_byte"
    errors = [line for line in vllm_log.lines() if "invalid kv_connector_extra_config" in line]
    assert len(errors) == 1 and "'cpu_byte'" in errors[0]


def test_under_the_vllm_command_a_bad_config_exits_2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["/usr/bin/vllm", "serve", "m"])
    assert plugin.running_vllm_command()
    with pytest.raises(SystemExit) as caught:
        plugin.check_transfer_config(transfer({"cpu_bytes": -1}))
    assert caught.value.code == 2
    monkeypatch.setattr(sys, "argv", ["python", "app.py"])
    assert not plugin.running_vllm_command()


def test_only_kvoffload_configs_are_checked(tmp_path: Any) -> None:
    assert plugin.check_transfer_config(None) is None
    assert plugin.check_transfer_config({"kv_connector": "OffloadingConnector"}) is None
    other = transfer({"bad": 1}, kv_connector_module_path="someone.else")
    assert plugin.check_transfer_config(other) is None
    good = plugin.check_transfer_config(transfer({"cpu_bytes": 5}))
    assert good is not None and good.cpu_bytes == 5
    missing = transfer(
        {"cpu_bytes": 5, "redis_url": "redis://h:1", "redis_password_file": str(tmp_path / "x")}
    )
    with pytest.raises(ConfigError, match="redis_password_file"):
        plugin.check_transfer_config(missing)


def test_kvoffload_records_come_out_on_vllm_handlers(vllm_log: Capture) -> None:
    assert attach_to_vllm_logging()
    assert attach_to_vllm_logging()  # idempotent
    ours = logging.getLogger("kvoffload")
    assert sum(isinstance(h, ToVllmHandlers) for h in ours.handlers) == 1
    ours.info("kvoffload: hello from the test")
    assert "kvoffload: hello from the test" in vllm_log.lines()
    vllm_level = logging.getLogger("vllm").level
    logging.getLogger("vllm").setLevel(logging.WARNING)  # VLLM_LOGGING_LEVEL=WARNING
    try:
        ours.info("kvoffload: not shown")
    finally:
        logging.getLogger("vllm").setLevel(vllm_level)
    assert "kvoffload: not shown" not in vllm_log.lines()


def test_the_summary_names_every_tier_and_never_a_password(vllm_log: Capture) -> None:
    attach_to_vllm_logging()
    config = OffloadConfig.from_dict(
        {
            "cpu_bytes": 64 << 20,
            "disk_path": "/var/kvoffload",
            "disk_bytes": 1 << 30,
            "redis_url": f"redis://kv:{SECRET}@cache:6379/2",
        }
    )
    line = scheduler_summary(
        config,
        chunk_tokens=32,
        chunk_bytes=1 << 20,
        world_size=2,
        host_chunks=64,
        tier_chunks={"disk": 1000},
        load_failure_policy="recompute",
    )
    for part in (
        "host 64.0 MiB = 64 chunks",
        "disk /var/kvoffload 1.0 GiB = 1000 chunks",
        "redis redis://kv:***@cache:6379/2 (password inline)",
        "over 2 ranks",
    ):
        assert part in line, (part, line)
    assert SECRET not in line
    warn_tiers(config)
    (warning,) = [r for r in vllm_log.records if r.levelno == logging.WARNING]
    assert "redis_password_file" in warning.getMessage() and SECRET not in warning.getMessage()


def test_an_unreachable_redis_is_a_warning_at_start(vllm_log: Capture) -> None:
    attach_to_vllm_logging()

    class Down:
        def ping(self) -> None:
            raise ConnectionError("Connection refused")

    config = OffloadConfig.from_dict({"cpu_bytes": 1, "redis_url": f"redis://:{SECRET}@h:1"})
    probe(Down(), config)
    (warning,) = vllm_log.lines()
    assert "does not answer" in warning and "redis://:***@h:1" in warning
    assert SECRET not in warning


def multi(*children: dict[str, Any]) -> dict[str, Any]:
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": list(children)},
    }


def test_kvoffload_inside_a_multiconnector_is_checked_too() -> None:
    nixl = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
    good = plugin.check_transfer_config(multi(nixl, transfer({"cpu_bytes": 7})))
    assert good is not None and good.cpu_bytes == 7
    assert plugin.check_transfer_config(multi(nixl)) is None  # kvoffload not in it
    with pytest.raises(ConfigError) as caught:
        plugin.check_transfer_config(multi(nixl, transfer({"cpu_bytes": 1, "bogus": 2})))
    assert caught.value.field == "bogus"


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"pipeline_parallel_size": 2}, "pipeline_parallel_size"),
        ({"decode_context_parallel_size": 2}, "decode_context_parallel_size"),
        ({"prefill_context_parallel_size": 2}, "prefill_context_parallel_size"),
    ],
)
def test_unsupported_parallelism_is_refused_before_vllm_builds_anything(
    vllm_log: Capture, tmp_path: Any, args: dict[str, int], field: str
) -> None:
    from vllm.engine.arg_utils import EngineArgs

    plugin.register()
    engine = EngineArgs(
        model=str(tmp_path / "no-such-model"),  # never read: the check comes first
        kv_transfer_config=transfer({"cpu_bytes": 1 << 20}),  # type: ignore[arg-type]
        **args,  # type: ignore[arg-type]
    )
    with pytest.raises(ConfigError) as caught:
        engine.create_engine_config()
    assert caught.value.field == field
    (line,) = [x for x in vllm_log.lines() if "unsupported deployment" in x]
    assert field in line and "kvoffload does not serve" in line


def test_a_one_way_kv_role_is_refused_in_one_line() -> None:
    from kvoffload.adapters.vllm.deployment import deployment_problem

    assert deployment_problem() is None
    assert deployment_problem(kv_role=None) is None
    for role in ("kv_producer", "kv_consumer"):
        problem = deployment_problem(kv_role=role)
        assert problem is not None and problem.field == "kv_role" and "kv_both" in str(problem)
    with pytest.raises(ConfigError, match="kv_role"):
        plugin.check_engine_args(object(), [transfer({"cpu_bytes": 1}, kv_role="kv_consumer")])
