"""The kvoffload connectors of one harness engine, each with its own checks.

Alone, the engine's connector is kvoffload's; under ``HarnessSpec.beside`` it is
vLLM's ``MultiConnector`` over two kvoffload connectors: another one first (standing
in for a P/D connector that loads into the engine's blocks at times of its own) and
kvoffload under test last. Each :class:`Unit` is one of them in the scheduler
process: its scheduler side and a :class:`Checks` of its own (its plans, loads,
integrity, quiescence), so both are held to every rule; the KV model's read checks
cover every forward pass whoever filled the blocks. :func:`make_units` builds them and
makes each scheduler half deterministic (logical clock, fixed lane costs, a Redis
index without its thread).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
from vllm.v1.core.sched.scheduler import Scheduler

from kvoffload.adapters.vllm.connector import KVOffloadConnector
from kvoffload.adapters.vllm.scheduler_side import SchedulerSide
from kvoffload.core.cost import LaneCosts, fixed_timing
from kvoffload.testing.vllm_harness.checks import Checks
from kvoffload.testing.vllm_harness.kv_model import KVModel
from kvoffload.tiers.registry import LOWER_TIERS
from kvoffload.tiers.remote_index import RemoteIndex, RemoteIndexOptions
from kvoffload.tiers.spec import OpenedIndex


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


def make_units(
    scheduler: Scheduler,
    model: KVModel,
    *,
    clock: Callable[[], float],
    lane_costs: Mapping[str, LaneCosts],
    check_provenance: bool,
    expect_anomalies: bool,
) -> list[Unit]:
    """The scheduler's kvoffload connectors as units, each made deterministic: its
    scheduler half on the harness's logical ``clock``, its cost model on the fixed
    ``lane_costs``, its remote indexes without a thread (:func:`deterministic_remote_indexes`)."""
    units = []
    for index, kid in enumerate(kvoffload_children(scheduler.connector)):
        side = kid.scheduler_side
        assert side is not None  # checked by kvoffload_children
        side.scheduler.clock = clock
        side.scheduler.cost.timing = fixed_timing(lane_costs)
        deterministic_remote_indexes(side, clock)
        checks = Checks(
            scheduler,
            side,
            model,
            check_provenance=check_provenance,
            expect_anomalies=expect_anomalies,
        )
        units.append(Unit(index, kid, side, checks))
    return units


def deterministic_remote_indexes(side: SchedulerSide, clock: Callable[[], float]) -> None:
    """Swap each of the scheduler side's remote indexes (the Redis tier's) for one over
    the same store without its thread, in logical time, probing in the background (the
    harness answers their queries after each step: lookups of unknown chunks are
    deferred a step); the old ones are closed."""
    for spec in LOWER_TIERS:
        old = side.lower_tier(spec.name)
        if not isinstance(old, RemoteIndex):
            continue
        options = RemoteIndexOptions(probe="async", clock=clock, background=False)
        index = RemoteIndex(old.name, old.query, options)
        side.replace_lower_tier(OpenedIndex(index, index.close))
