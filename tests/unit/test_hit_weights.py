"""Each tier's learned load cost and hit weight for routers
(``core/cost/hit_weights.py``, the ``tier_*`` gauges): from lane timings given here,
never measured, and a prefill speed seeded or stepped by hand."""

from __future__ import annotations

import math

import pytest
from tests.unit.test_cost import RATE, Rig
from tests.unit.test_scheduler import BS, NS, Clock, ok

from kvoffload.core.cost import CostModel, LaneCosts, fixed_timing, hit_weight, tier_costs
from kvoffload.core.cost.model import HOST
from kvoffload.core.directory import Directory
from kvoffload.core.kv_groups import KVGroup, KVGroups
from kvoffload.core.observe.metrics_view import read_metrics
from kvoffload.core.scheduler import OffloadScheduler
from kvoffload.core.scheduler_types import SchedulerConfig, StepInput

CHUNK = 16  # tokens per chunk: recomputing one takes 16 ms at RATE


def model(**lanes: LaneCosts) -> CostModel:
    """A cost model at RATE whose lanes took exactly their ``LaneCosts`` (jobs of 1,
    2, 4 and 8 chunks: the fit finds both terms)."""
    cost = CostModel(
        prefill_tokens_per_s=RATE, always=False, in_flight=lambda: (), clock=lambda: 0.0
    )
    for name, costs in lanes.items():
        for chunks in (1, 2, 4, 8):
            cost.lane(name).observe(chunks, 0, costs.latency_s + chunks * costs.s_per_chunk)
    return cost


def by_tier(cost: CostModel, **kwargs: object) -> dict[str, tuple[float, float]]:
    return {
        t.tier: (t.load_s_per_chunk, t.hit_weight)
        for t in tier_costs(cost, chunk_tokens=CHUNK, **kwargs)  # type: ignore[arg-type]
    }


def test_each_tier_s_load_cost_and_the_prefill_time_a_hit_saves() -> None:
    cost = model(
        host=LaneCosts(0.001, 0.002),  # 3 ms a chunk against 16 ms: saves 13/16
        disk=LaneCosts(0.002, 0.010),  # 12 ms: saves 4/16
        redis=LaneCosts(0.004, 0.100),  # 104 ms: slower than recomputing, clamped to 0
    )
    got = by_tier(cost)
    assert list(got) == ["disk", "host", "redis"]
    assert got["host"] == pytest.approx((0.003, 0.8125))
    assert got["disk"] == pytest.approx((0.012, 0.25))
    assert got["redis"] == pytest.approx((0.104, 0.0))


def test_an_unmeasured_lane_has_no_figures() -> None:
    cost = model(host=LaneCosts(0.0, 0.001))
    cost.lane("disk")  # decided on, never measured
    assert cost.lane("disk").fit() is None
    assert list(by_tier(cost)) == ["host"]
    assert by_tier(model()) == {}


def test_the_weight_follows_the_measured_prefill_speed() -> None:
    cost = model(disk=LaneCosts(0.0, 0.008))  # 8 ms a chunk: half of 16 ms at the seed
    assert by_tier(cost)["disk"][1] == pytest.approx(0.5)
    cost.prefill.step(0.0, 64)
    cost.prefill.step(0.032, 0)  # 64 tokens in 32 ms: 2000 tokens/s, 8 ms a chunk
    assert by_tier(cost)["disk"] == pytest.approx((0.008, 0.0))


def test_a_chunk_of_tokens_is_one_chunk_per_kv_cache_group() -> None:
    cost = model(host=LaneCosts(0.002, 0.002))
    assert by_tier(cost)["host"] == pytest.approx((0.004, 0.75))
    assert by_tier(cost, groups=3)["host"] == pytest.approx((0.004, 0.5))  # 2 + 3 x 2 ms


def test_promoted_hits_add_host_memory_s_load() -> None:
    cost = model(disk=LaneCosts(0.002, 0.006))
    assert list(by_tier(cost, through_host=True)) == []  # host memory unmeasured yet
    cost = model(host=LaneCosts(0.0, 0.002), disk=LaneCosts(0.002, 0.006))
    got = by_tier(cost, through_host=True)
    assert got["disk"] == pytest.approx((0.010, 0.375))
    assert got["host"] == pytest.approx((0.002, 0.875))


def test_hit_weight_is_clamped_and_never_nan() -> None:
    assert hit_weight(0.0, CHUNK, RATE) == 1.0
    assert hit_weight(-1.0, CHUNK, RATE) == 1.0  # nonsense: clamped
    assert hit_weight(0.004, CHUNK, RATE) == pytest.approx(0.75)
    assert hit_weight(1.0, CHUNK, RATE) == 0.0
    assert hit_weight(math.inf, CHUNK, RATE) == 0.0
    assert hit_weight(math.nan, CHUNK, RATE) == 0.0
    assert hit_weight(0.004, 0, RATE) == 0.0
    assert hit_weight(0.004, CHUNK, 0.0) == 0.0
    assert hit_weight(0.0, CHUNK, math.inf) == 0.0  # 0 x inf


# ------------------------------------------------------------------ the gauges


def scheduler(**config: object) -> OffloadScheduler:
    settings = SchedulerConfig(
        block_size=BS,
        blocks_per_chunk=4,  # CHUNK tokens
        prefill_tokens_per_s=RATE,
        world_size=1,
        **config,  # type: ignore[arg-type]
    )
    return OffloadScheduler(settings, Directory(16), NS, clock=Clock())


def tier_gauges(s: OffloadScheduler) -> dict[tuple[str, str], float]:
    gauges = read_metrics(s, 64).gauges
    assert all(math.isfinite(v) for v in gauges.values())
    return {
        (name, dict(pairs)["tier"]): v
        for (name, pairs), v in gauges.items()
        if name.startswith("tier_")
    }


def test_the_gauges_are_there_once_a_lane_is_measured() -> None:
    s = scheduler()
    assert tier_gauges(s) == {}
    s.cost.lane("disk")  # decided on, unmeasured: still absent
    for chunks in (1, 3):
        s.cost.lane(HOST).observe(chunks, 0, 0.001 + chunks * 0.001)
    assert tier_gauges(s) == pytest.approx(
        {("tier_load_seconds_per_chunk", "host"): 0.002, ("tier_hit_weight", "host"): 0.875}
    )


def test_the_gauges_read_the_engine_s_groups_and_load_mode() -> None:
    groups = KVGroups((KVGroup(), KVGroup(window=8)))
    s = scheduler(kv_groups=groups, direct_tier_loads=False)
    for name, per_chunk in ((HOST, 0.002), ("disk", 0.004)):
        for chunks in (1, 3):
            s.cost.lane(name).observe(chunks, 0, chunks * per_chunk)
    assert tier_gauges(s) == pytest.approx(
        {
            ("tier_load_seconds_per_chunk", "host"): 0.002,
            ("tier_hit_weight", "host"): 0.75,  # two groups' chunks: 4 ms of 16
            ("tier_load_seconds_per_chunk", "disk"): 0.006,  # promoted, then loaded
            ("tier_hit_weight", "disk"): 0.25,
        }
    )


def test_a_tier_load_teaches_the_gauges_through_the_scheduler_half() -> None:
    """A disk hit loaded straight into the engine and reported done: its lane's
    timing (fixed here) is the disk's figures, the prefill seed the weight's speed."""
    rig = Rig()
    assert rig.ask("a") == 16
    rig.admit("a")
    rig.s.cost.timing = fixed_timing({"disk": LaneCosts(0.0, 0.001)})
    (load,) = rig.s.build_plan(StepInput()).loads
    rig.s.on_report(ok([load]))
    gauges = tier_gauges(rig.s)
    assert gauges == pytest.approx(
        {("tier_load_seconds_per_chunk", "disk"): 0.001, ("tier_hit_weight", "disk"): 0.75}
    )
