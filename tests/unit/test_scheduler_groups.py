"""The scheduler half with several KV cache groups: the directory holds one chunk per
(group, chunk of tokens), so reuse counts and a hit's recency are per group key, and
each chunk's group travels with its spills and promotions.

Found by the vLLM fuzzer once it drew KV cache groups: admission counted and a hit
touched the chain keys, which with several groups name no chunk in the directory;
with ``store_threshold`` 2 nothing was ever stored, and a hit did not keep its chunks
from being evicted first."""

from __future__ import annotations

from tests.unit.test_scheduler import BS, Req, ok  # BS tokens per block; one block per chunk

from kvoffload.core.directory import Directory
from kvoffload.core.jobs import StepPlan
from kvoffload.core.keys import Namespace
from kvoffload.core.kv_groups import KVGroup, KVGroups
from kvoffload.core.scheduler import OffloadScheduler
from kvoffload.core.scheduler_types import ScheduledRequest, SchedulerConfig, StepInput
from kvoffload.core.tiering.lower import DirectoryTier

NS = Namespace("m", "layout", "f32")
GROUPS = KVGroups((KVGroup(), KVGroup(window=8)))


def make(slots: int, **directory: object) -> OffloadScheduler:
    config = SchedulerConfig(block_size=BS, blocks_per_chunk=1, world_size=1, kv_groups=GROUPS)
    return OffloadScheduler(config, Directory(slots, **directory), NS)  # type: ignore[arg-type]


def step(
    s: OffloadScheduler, req: Req, start: int, tables: tuple[tuple[int, ...], ...]
) -> StepPlan:
    """One step computing ``req`` from ``start`` to its end; its jobs complete."""
    scheduled = ScheduledRequest(req.request_id, start, req.num_tokens - start, tables, True)
    plan = s.build_plan(StepInput((scheduled,)))
    s.on_report(ok(plan.stores))
    req.num_computed_tokens = req.num_tokens
    return plan


def serve(s: OffloadScheduler, req: Req, tables: tuple[tuple[int, ...], ...]) -> int:
    """Look ``req`` up, load what is offered, compute the rest, finish; the tokens
    loaded."""
    hit = s.lookup(req, 0)
    assert hit is not None
    s.on_allocated(req, tables, hit)
    if hit:
        plan = s.build_plan(StepInput())
        s.on_report(ok(plan.loads))
    step(s, req, hit, tables)
    s.on_finished(req.request_id)
    s.build_plan(StepInput())
    s.check_integrity()
    return hit


def test_reuse_is_counted_per_group_so_a_store_threshold_admits() -> None:
    s = make(16, store_threshold=2)
    doc = list(range(8))  # two chunks
    tables = ((1, 2), (3, 4))
    assert serve(s, Req("a", doc), tables) == 0
    assert (
        s.metrics.value("transferred_chunks_total", direction="store", tier="host") == 0
    )  # asked for once: not admitted
    assert serve(s, Req("b", doc), tables) == 0
    assert (
        s.metrics.value("transferred_chunks_total", direction="store", tier="host") == 4
    )  # twice: both chunks of both groups
    assert s.lookup(Req("c", [*doc, 9, 9]), 0) == 8


def test_a_hit_keeps_its_chunks_from_being_evicted_first() -> None:
    s = make(4, policy="lru")  # two chunks of both groups
    first, second = [1, 2, 3, 4], [5, 6, 7, 8]
    serve(s, Req("a", first), ((1,), (2,)))
    serve(s, Req("b", second), ((3,), (4,)))
    assert serve(s, Req("a2", [*first, 0, 0]), ((5, 6), (7, 8))) == 4  # touches first
    serve(s, Req("c", [9, 9, 9, 9]), ((1,), (2,)))  # evicts the least recent: second
    assert s.lookup(Req("a3", [*first, 1]), 0) == 4
    assert s.lookup(Req("b2", [*second, 1]), 0) == 0


def test_spills_and_promotions_carry_each_chunk_s_group() -> None:
    """The host directory keeps the group of each chunk a store prepared; a spill
    carries those groups to the lower tier, and the promotion a later hit wishes asks
    for the same groups back (from the planner's entries), kept again on host."""
    config = SchedulerConfig(
        block_size=BS,
        blocks_per_chunk=1,
        world_size=1,
        kv_groups=GROUPS,
        direct_tier_loads=False,
    )
    disk = DirectoryTier(Directory(16, tier="disk"))
    s = OffloadScheduler(config, Directory(16), NS, lower_tiers=[disk])
    doc, tables = list(range(8)), ((1, 2), (3, 4))  # two chunks of both groups
    req = Req("a", doc)
    assert s.lookup(req, 0) == 0
    s.on_allocated(req, tables, 0)
    (store,) = step(s, req, 0, tables).stores
    group_of = dict(zip(store.keys, s.directory.groups_of(store.slots), strict=True))
    assert sorted(group_of.values()) == [0, 0, 1, 1]  # entries chunk by chunk, both groups
    s.on_finished("a")
    plan = s.build_plan(StepInput())
    (spill,) = plan.spills
    assert set(spill.keys) == set(group_of)
    assert spill.groups == tuple(group_of[k] for k in spill.keys)
    s.on_report(ok(plan.spills))

    s.directory.discard(list(group_of))  # evicted from host memory, held on disk
    again = Req("b", [*doc, 9])
    assert s.lookup(again, 0) is None  # retry later: a promotion is wished
    plan = s.build_plan(StepInput())
    (promotion,) = plan.promotions
    assert set(promotion.keys) == set(group_of)
    assert promotion.groups == tuple(group_of[k] for k in promotion.keys)
    assert s.directory.groups_of(promotion.slots) == promotion.groups
    s.on_report(ok(plan.promotions))
    assert s.lookup(again, 0) == 8
    s.check_integrity()


def test_a_tier_load_reads_each_chunk_s_group_from_the_tier() -> None:
    """With direct tier loads, a hit held on disk only is offered at once and loaded
    straight into the engine's blocks of both groups: one load job, every chunk read
    from the tier (NO_SLOT) with its group, the tier's copies pinned until reported."""
    config = SchedulerConfig(block_size=BS, blocks_per_chunk=1, world_size=1, kv_groups=GROUPS)
    disk = DirectoryTier(Directory(16, tier="disk"))
    s = OffloadScheduler(config, Directory(16), NS, lower_tiers=[disk])
    doc, tables = list(range(8)), ((1, 2), (3, 4))
    req = Req("a", doc)
    assert s.lookup(req, 0) == 0
    s.on_allocated(req, tables, 0)
    (store,) = step(s, req, 0, tables).stores
    group_of = dict(zip(store.keys, s.directory.groups_of(store.slots), strict=True))
    s.on_finished("a")
    plan = s.build_plan(StepInput())
    s.on_report(ok(plan.spills))
    s.directory.discard(list(group_of))  # evicted from host memory, held on disk

    again = Req("b", [*doc, 9])
    assert s.lookup(again, 0) == 8  # offered at once: no promotion, no deferral
    s.on_allocated(again, ((5, 6, 7), (8, 9, 10)), 8)
    plan = s.build_plan(StepInput())
    (load,) = plan.loads
    assert not plan.promotions and load.tier == "disk"
    assert load.tier_chunks() == tuple(range(len(load.keys))) and set(load.keys) == set(group_of)
    assert load.groups == tuple(group_of[k] for k in load.keys)
    assert disk.directory.pinned_count == len(load.keys)
    s.check_integrity()
    s.on_report(ok(plan.loads))
    assert disk.directory.pinned_count == 0
    assert disk.metrics.value("transferred_chunks_total", direction="load") == 4
    s.check_integrity()
