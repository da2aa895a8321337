"""The load-failure policy kvoffload needs, set where vLLM's scheduler reads it.

kvoffload is a best-effort cache: a load that fails (a torn disk chunk, a Redis
server gone, a tier past its deadline) must be recomputed, never fail the request.
vLLM's scheduler decides that from ``kv_load_failure_policy`` of the
``kv_transfer_config`` it was built with, read once, right after it has constructed
its connector (default ``"fail"``).

Alone, kvoffload's connector is handed that very config object and sets the field on
it. Inside vLLM's ``MultiConnector`` (the P/D shape: NIXL or another loading
connector beside kvoffload) each child is handed a *copy* of the engine config with a
``kv_transfer_config`` of its own; setting the field there changes nothing the
scheduler reads. :func:`enforce_recompute` therefore finds the configs of the
connectors that are building kvoffload (the ``vllm_config`` argument of every
enclosing connector constructor on the call stack: ``MultiConnector.__init__``
builds its children in its own constructor, and the scheduler reads the policy only
after that constructor returned) and sets the policy on each. It returns what it did,
for the start-up line. The vLLM plugin sets the same policy on the engine's config
when it is built (``plugin.py``), so a ``MultiConnector`` naming kvoffload gets it
even where the call stack would not show the parent.

Contract: mutates only ``kv_load_failure_policy`` of the configs named above; reads
at most :data:`MAX_FRAMES` frames; never raises.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from types import FrameType
from typing import Any

RECOMPUTE = "recompute"
MAX_FRAMES = 32
"""How far up the call stack the enclosing connectors are looked for."""


@dataclass(frozen=True)
class PolicyOutcome:
    """What :func:`enforce_recompute` found and changed."""

    was: str  # the policy the scheduler would have read
    parents: int  # enclosing connectors (0: kvoffload is the engine's connector)

    def describe(self) -> str:
        where = " on MultiConnector's kv_transfer_config" if self.parents else ""
        if self.was == RECOMPUTE:
            return RECOMPUTE + (" (MultiConnector's)" if self.parents else "")
        return f"{RECOMPUTE} (set by kvoffload{where}; was {self.was!r})"


def enforce_recompute(transfer: Any, connector: object) -> PolicyOutcome:
    """Put ``recompute`` in force for the scheduler building ``connector``.

    ``transfer``: the ``kv_transfer_config`` kvoffload was handed. The policy the
    scheduler reads is the outermost enclosing connector's; the function sets it on
    every config on the way (see the module docstring)."""
    parents = enclosing_transfer_configs(connector, sys._getframe(1))
    targets = [transfer, *parents]
    was = str(getattr(targets[-1], "kv_load_failure_policy", "fail"))
    for config in targets:
        if getattr(config, "kv_load_failure_policy", None) != RECOMPUTE:
            config.kv_load_failure_policy = RECOMPUTE
    return PolicyOutcome(was=was, parents=len(parents))


def enclosing_transfer_configs(connector: object, frame: FrameType | None) -> list[Any]:
    """The ``kv_transfer_config`` of every connector constructor above ``frame`` that
    is building another connector than ``connector`` (innermost first)."""
    from kvoffload.adapters.vllm.compat import KVConnectorBase_V1

    found: list[Any] = []
    seen: set[int] = set()
    for _ in range(MAX_FRAMES):
        if frame is None:
            break
        local = frame.f_locals
        owner = local.get("self")
        config = local.get("vllm_config")
        if (
            frame.f_code.co_name == "__init__"
            and owner is not connector
            and isinstance(owner, KVConnectorBase_V1)
            and config is not None
        ):
            transfer = getattr(config, "kv_transfer_config", None)
            if transfer is not None and id(transfer) not in seen:
                seen.add(id(transfer))
                found.append(transfer)
        frame = frame.f_back
    return found
