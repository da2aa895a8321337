"""The simulated worker's cost of a tier load: its host chunks on the host -> engine
lane, its tier chunks read on the tier's lane then copied on the tier's staging lane;
reported once both halves finished."""

from __future__ import annotations

import pytest

from kvoffload.core.jobs import NO_SLOT, EngineJob, JobKind, StepPlan, TierJob
from kvoffload.core.keys import ChunkKey
from kvoffload.simulate.cost import CostModel
from kvoffload.simulate.request import StepMeter
from kvoffload.simulate.worker import SimClock, SimWorker

CHUNK = 10**9  # one chunk: 1 GB, so seconds are 1 / bandwidth in GB/s
COST = CostModel(host_gbps=10.0, tier_gbps={"disk": 2.0, "redis": 1.0})


def key(i: int) -> ChunkKey:
    return ChunkKey(i.to_bytes(16, "big"))


def load(job_id: int, slots: list[int], tier: str = "disk") -> EngineJob:
    n = len(slots)
    tier_chunks = slots.count(NO_SLOT)
    return EngineJob(
        job_id, JobKind.LOAD, "r", tuple(key(i) for i in range(n)), tuple(slots),
        tuple(range(n)), 1, tier=tier, tier_slots=tuple(range(tier_chunks)),
    )  # fmt: skip


def worker() -> SimWorker:
    return SimWorker(COST, CHUNK, SimClock(), StepMeter())


def finish_at(w: SimWorker, end: float) -> list[int]:
    """Ids of the jobs reported by a step ending at ``end``."""
    w.clock.step_end = end
    return [r.job_id for r in w.poll()[0].results]


@pytest.mark.parametrize(("tier", "read_s"), [("disk", 0.5), ("redis", 1.0)])
def test_a_tier_load_costs_its_host_copy_and_its_read_then_staging_copy(
    tier: str, read_s: float
) -> None:
    w = worker()
    job = load(1, [0, NO_SLOT, NO_SLOT], tier)  # 1 host chunk, 2 tier chunks
    w.begin(StepPlan(1, loads=(job,)))
    w.submit(job)
    tier_end = 2 * read_s + 2 * 0.1  # the read, then the staging copy
    assert w.finish_of[1] == pytest.approx(tier_end)
    assert w.traffic.busy_s == pytest.approx(
        {"host->engine": 0.1, tier: 2 * read_s, f"{tier}->engine": 0.2}
    )
    assert finish_at(w, tier_end - 1e-9) == []  # the host half alone is not reported
    w.clock.step_end = tier_end
    (result,) = w.poll()[0].results
    assert result.success and result.nbytes == 3 * CHUNK
    assert result.seconds == pytest.approx(tier_end)
    assert w.traffic.chunks[("load", "host")] == 1
    assert w.traffic.chunks[("load", tier)] == 2


def test_tier_loads_of_one_tier_run_one_after_the_other_and_share_its_lane() -> None:
    w = worker()
    promote = TierJob(1, JobKind.PROMOTE, (key(9),), (0,), "disk", (9,), "p")
    first, second = load(2, [NO_SLOT]), load(3, [NO_SLOT])
    w.begin(StepPlan(1, loads=(first, second), promotions=(promote,)))
    for job in (promote, first, second):
        w.submit(job)
    assert w.finish_of[1] == pytest.approx(0.5)
    assert w.finish_of[2] == pytest.approx(1.0 + 0.1)  # read after the promotion's
    assert w.finish_of[3] == pytest.approx(1.1 + 0.5 + 0.1)  # after the first's copy
    assert finish_at(w, 2.0) == [1, 2, 3]
