"""The kvoffload connectors of one harness engine, each with its own checks.

Alone, the engine's connector is kvoffload's; under ``HarnessSpec.beside`` it is
vLLM's ``MultiConnector`` over two kvoffload connectors: another one first (standing
in for a P/D connector that loads into the engine's blocks at times of its own) and
kvoffload under test last. Each :class:`Unit` is one of them in the scheduler
process: its scheduler side and a :class:`Checks` of its own (its plans, loads,
integrity, quiescence), so both are held to every rule; the KV model's read checks
cover every forward pass whoever filled the blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

from kvoffload.adapters.vllm.connector import KVOffloadConnector
from kvoffload.adapters.vllm.scheduler_side import SchedulerSide
from kvoffload.testing.vllm_harness.checks import Checks


@dataclass
class Unit:
    index: int  # the child's place in the MultiConnector (0 alone)
    connector: KVOffloadConnector
    side: SchedulerSide
    checks: Checks


def kvoffload_children(connector: object) -> list[KVOffloadConnector]:
    """The scheduler's kvoffload connectors, in the ``MultiConnector``'s order."""
    if isinstance(connector, MultiConnector):
        kids = [c for c in connector.sub_connectors if isinstance(c, KVOffloadConnector)]
    elif isinstance(connector, KVOffloadConnector):
        kids = [connector]
    else:
        raise TypeError(f"the harness needs kvoffload's connector, got {type(connector)}")
    for kid in kids:
        if kid.scheduler_side is None:
            raise TypeError("a kvoffload connector without its scheduler role")
    return kids
