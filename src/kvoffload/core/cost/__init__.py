"""The cost model of loads against recomputation (decision 0013).

- :mod:`.lanes`: one lane's transfer time learned online from its jobs' timings;
- :mod:`.prefill`: the engine's prefill speed learned from step timings;
- :mod:`.decision`: the pure load-or-recompute decision with its hysteresis verdicts;
- :mod:`.probing`: a declined lane's probe, which re-measures it, and its backoff;
- :mod:`.model`: :class:`CostModel`, the scheduler half's one owner of all of it;
- :mod:`.hit_weights`: each tier's learned load cost and hit weight, for routers.

Pure Python; imports neither torch nor vllm.
"""

from kvoffload.core.cost.decision import Decline, Verdict, decide_lane
from kvoffload.core.cost.hit_weights import TierCost, hit_weight, tier_costs
from kvoffload.core.cost.lanes import LaneModel
from kvoffload.core.cost.model import CostModel, JobTiming, LaneCosts, fixed_timing
from kvoffload.core.cost.prefill import PrefillMeter
from kvoffload.core.cost.probing import PROBE_CHUNKS, LaneProbe, ProbeState

__all__ = [
    "PROBE_CHUNKS",
    "CostModel",
    "Decline",
    "JobTiming",
    "LaneCosts",
    "LaneModel",
    "LaneProbe",
    "PrefillMeter",
    "ProbeState",
    "TierCost",
    "Verdict",
    "decide_lane",
    "fixed_timing",
    "hit_weight",
    "tier_costs",
]
