"""kvoffload's vLLM plugin (entry point group ``vllm.general_plugins``).

vLLM runs every general plugin in each of its processes (the API server, the engine
core, every worker) before any model is loaded. kvoffload's plugin:

1. routes the ``kvoffload`` logger through vLLM's logging (``logs.py``);
2. registers the connector name ``KVOffloadConnector`` with vLLM's connector
   factory, so ``kv_connector_module_path`` may be left out;
3. checks a kvoffload ``kv_connector_extra_config`` when vLLM builds its engine
   configuration (``EngineArgs.create_engine_config``, the first step after the
   command line is parsed): an invalid key is reported at once, in one line
   naming it, instead of after the weights load and the KV cache is allocated.
   Under the ``vllm`` command the process then exits with status 2 and no
   traceback; in a Python program (``vllm.LLM``) the
   :class:`~kvoffload.core.errors.ConfigError` is raised to the caller. The same
   holds for kvoffload's child configs inside a ``MultiConnector``, and for a
   deployment kvoffload cannot serve (pipeline or context parallelism, a one-way
   ``kv_role``: ``deployment.py``), and a vLLM release kvoffload is not tested
   with (``versions.py``; ``KVOFFLOAD_ALLOW_UNTESTED_VLLM=1`` runs it anyway);
4. sets ``kv_load_failure_policy: recompute`` on the engine's built
   ``kv_transfer_config`` whenever kvoffload is in it (itself or a child of a
   ``MultiConnector``), where vLLM's scheduler reads it (``load_failure.py``).

Contract: :func:`register` is idempotent (vLLM may call it more than once) and never
raises: a failure of the plugin itself is logged and leaves vLLM as it was (the
connector's constructor still validates). The check reads files and environment
variables named by the configuration (each tier's ``TierSpec.settle``: a password
file or variable) but opens no connection.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kvoffload.adapters.vllm.deployment import deployment_problem
from kvoffload.adapters.vllm.logs import attach_to_vllm_logging
from kvoffload.adapters.vllm.versions import check_vllm_version
from kvoffload.core.config.typed import OffloadConfig
from kvoffload.core.errors import ConfigError
from kvoffload.sealing import policy as seal_policy
from kvoffload.tiers.registry import LOWER_TIERS

logger = logging.getLogger("kvoffload")

CONNECTOR_NAME = "KVOffloadConnector"
CONNECTOR_MODULE = "kvoffload.adapters.vllm.connector"
_CHECKED = "_kvoffload_checks_config"


def register() -> None:
    """The entry point vLLM calls (see the module docstring)."""
    try:
        attach_to_vllm_logging()
        register_connector_name()
        install_config_check()
    except Exception:
        logger.exception("kvoffload: the vLLM plugin failed; the connector still works")


def register_connector_name() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)


def install_config_check() -> None:
    from vllm.engine.arg_utils import EngineArgs

    original: Callable[..., Any] = EngineArgs.create_engine_config
    if getattr(original, _CHECKED, False):
        return

    @functools.wraps(original)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        transfer = getattr(self, "kv_transfer_config", None)
        if check_transfer_config(transfer) is not None:
            check_engine_args(self, kvoffload_transfers(transfer))
        engine_config = original(self, *args, **kwargs)
        built = getattr(engine_config, "kv_transfer_config", None)
        if built is not None and kvoffload_transfers(built):
            built.kv_load_failure_policy = "recompute"  # read by vLLM's scheduler
        return engine_config

    setattr(create_engine_config, _CHECKED, True)
    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]


def is_kvoffload(transfer: Any) -> bool:
    """Whether a ``kv_transfer_config`` (object or mapping) names kvoffload."""
    name, module = _field(transfer, "kv_connector"), _field(transfer, "kv_connector_module_path")
    if name != CONNECTOR_NAME:
        return False
    return module is None or str(module).startswith("kvoffload")


def kvoffload_transfers(transfer: Any) -> list[Any]:
    """kvoffload's connector configs in ``transfer``: itself, or the children of a
    ``MultiConnector`` (``kv_connector_extra_config["connectors"]``) that name
    kvoffload."""
    if transfer is None:
        return []
    if is_kvoffload(transfer):
        return [transfer]
    if _field(transfer, "kv_connector") != "MultiConnector":
        return []
    extra = _field(transfer, "kv_connector_extra_config")
    children = extra.get("connectors") if isinstance(extra, Mapping) else None
    if not isinstance(children, list):
        return []
    return [child for child in children if isinstance(child, Mapping) and is_kvoffload(child)]


def check_transfer_config(transfer: Any) -> OffloadConfig | None:
    """Validate kvoffload's part of ``transfer`` (kvoffload itself, or its child
    configs inside a ``MultiConnector``); None if kvoffload is not in it.

    On an invalid configuration: one ERROR line naming the key, then ``SystemExit(2)``
    under the ``vllm`` command, else the :class:`ConfigError`.
    """
    config: OffloadConfig | None = None
    for ours in kvoffload_transfers(transfer):
        try:
            extra = _field(ours, "kv_connector_extra_config")
            config = OffloadConfig.from_dict({} if extra is None else extra)
            for spec in LOWER_TIERS:
                spec.settle(config)  # e.g. a password file that cannot be read
            seal_policy.settle(config, LOWER_TIERS)  # the seal key file, seal_required
        except ConfigError as exc:
            _refuse("invalid kv_connector_extra_config", exc)
    return config


def check_engine_args(args: Any, transfers: list[Any]) -> None:
    """Refuse a deployment kvoffload cannot serve (``deployment.py``) from the engine
    arguments, before anything is built; same reporting as
    :func:`check_transfer_config`."""
    if transfers:
        try:
            check_vllm_version()
        except ConfigError as exc:
            _refuse("untested vLLM", exc)
    for ours in transfers:
        problem = deployment_problem(
            pipeline_parallel_size=int(getattr(args, "pipeline_parallel_size", 1) or 1),
            decode_context_parallel_size=int(getattr(args, "decode_context_parallel_size", 1) or 1),
            prefill_context_parallel_size=int(
                getattr(args, "prefill_context_parallel_size", 1) or 1
            ),
            kv_role=_field(ours, "kv_role"),
        )
        if problem is not None:
            _refuse("unsupported deployment", problem)


def _refuse(what: str, exc: ConfigError) -> None:
    logger.error("kvoffload: %s: %s", what, exc)
    if running_vllm_command():
        raise SystemExit(2) from None
    raise exc


def running_vllm_command() -> bool:
    """This process is vLLM's command line (``vllm serve``, ``python -m vllm...``)."""
    argv0 = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path()
    return argv0.name == "vllm" or argv0.as_posix().endswith("vllm/entrypoints/cli/main.py")


def _field(transfer: Any, name: str) -> Any:
    if isinstance(transfer, Mapping):
        return transfer.get(name)
    return getattr(transfer, name, None)
