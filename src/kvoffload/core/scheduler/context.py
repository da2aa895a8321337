"""What every part of the scheduler half shares: one value, built by the façade."""

from __future__ import annotations

from dataclasses import dataclass

from kvoffload.core.cost import CostModel
from kvoffload.core.directory import HostDirectory
from kvoffload.core.identity.weights import WeightsState
from kvoffload.core.observe.anomalies import AnomalyLog
from kvoffload.core.observe.recorder import MetricsRecorder
from kvoffload.core.scheduler.deferral import DeferralClock
from kvoffload.core.scheduler.requests import RequestTable
from kvoffload.core.scheduler_types import SchedulerConfig, SchedulerStats
from kvoffload.core.tiering.planning import TierPlanner


@dataclass(frozen=True)
class Context:
    """The collaborators (each the one owner of its state): the host directory, the
    tier planner (lower tiers), the request table (states; it holds the job
    tracker), the deferral clock, the job counts, the metrics recorder (every exported
    counter), the anomaly log, the cost model (load or recompute) and what is known of
    the weights (decision 0019; the façade alone mutates it)."""

    config: SchedulerConfig
    directory: HostDirectory
    tiers: TierPlanner
    requests: RequestTable
    deferral: DeferralClock
    stats: SchedulerStats
    metrics: MetricsRecorder
    anomalies: AnomalyLog
    cost: CostModel
    weights: WeightsState
