"""The reference engine as a hybrid model (GroupTables and the checking GroupModel)
with kvoffload: every position a group reads is checked byte for byte, so a load
into a wrong block, group or position, or a block overwritten under a store, fails
the run; outputs are the reference model's."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvoffload.core.directory import Directory
from kvoffload.core.kv_groups import KVGroup, KVGroups
from kvoffload.core.scheduler import OffloadScheduler
from kvoffload.core.scheduler_types import SchedulerConfig
from kvoffload.core.step_runner import StepRunner
from kvoffload.engine.batcher import Batcher
from kvoffload.engine.block_pool import BlockPool
from kvoffload.engine.engine import ReferenceEngine
from kvoffload.engine.group_model import GroupModel
from kvoffload.engine.group_tables import NULL_BLOCK, GroupTables
from kvoffload.engine.manual_worker import (
    CompletionPolicy,
    InvariantViolation,
    ManualWorker,
    PendingJob,
    complete_everything,
)
from kvoffload.engine.model import reference_outputs
from kvoffload.engine.settings import EngineConfig, StepMode
from kvoffload.testing.run import NAMESPACE

VOCAB, BS = 1000, 4
GROUPS = KVGroups((KVGroup(), KVGroup(window=8), KVGroup(window=8)))


def hybrid_engine(
    mode: StepMode, caching: bool, blocks: int = 60, policy: CompletionPolicy = complete_everything
) -> tuple[ReferenceEngine, GroupModel]:
    config = EngineConfig(num_blocks=blocks, block_size=BS, token_budget=12, max_running=3,
                          vocab=VOCAB, mode=mode, enable_prefix_caching=caching)  # fmt: skip
    pool = BlockPool(blocks, BS)
    pool.caching = caching
    tables = GroupTables(pool, GROUPS)
    scheduler = OffloadScheduler(
        SchedulerConfig(block_size=BS, kv_groups=GROUPS, null_block=NULL_BLOCK),
        Directory(256),
        NAMESPACE,
    )
    batcher = Batcher(config, pool, scheduler, registration=tables, tables=tables)
    model = GroupModel(pool, tables, VOCAB)
    worker = StepRunner(ManualWorker(pool, 256, policy=policy))
    return ReferenceEngine(config, scheduler, worker, pool, model=model, batcher=batcher), model


def run_to_end(e: ReferenceEngine, limit: int = 2000) -> None:
    assert e.run_until_idle(limit)


PREFIX = list(range(10, 34))  # 6 blocks: longer than the windows


@pytest.mark.parametrize("mode", list(StepMode))
@pytest.mark.parametrize("caching", [True, False])
def test_outputs_are_the_reference_and_hits_load_every_group(mode: StepMode, caching: bool) -> None:
    e, model = hybrid_engine(mode, caching, blocks=40)
    prompts = {f"r{i}": PREFIX + [50 + i] * (3 + i % 4) for i in range(8)}
    for rid, prompt in list(prompts.items())[:4]:
        e.add_request(rid, prompt, 6)
    run_to_end(e)
    for rid, prompt in list(prompts.items())[4:]:  # the prefix again, later
        e.add_request(rid, prompt, 6)
        prompts[rid + "x"] = PREFIX + [7, 7]
        e.add_request(rid + "x", PREFIX + [7, 7], 3)
    run_to_end(e)
    for rid, req in e.requests.items():
        assert req.output == reference_outputs(prompts[rid], req.max_tokens, VOCAB), rid
    assert e.scheduler is not None
    e.scheduler.check_integrity()
    assert e.scheduler.anomalies.counts == {}
    assert model.checked > 0
    hits = e.scheduler.metrics.value("hit_tokens_total", tier="host")
    if not caching:  # every later prefix comes from kvoffload
        assert hits >= len(PREFIX) and e.scheduler.stats.loads > 0


def every_third_step(step: int, jobs: Sequence[PendingJob]) -> dict[int, bool]:
    """Jobs complete only every third step: stores stay in flight while windows free
    their blocks and the pool hands them out again (fences must flush them)."""
    return {p.job.job_id: True for p in jobs} if step % 3 == 0 else {}


@pytest.mark.parametrize("mode", list(StepMode))
def test_preemption_and_slow_stores_with_windows_keep_outputs_right(mode: StepMode) -> None:
    e, _ = hybrid_engine(mode, caching=False, blocks=24, policy=every_third_step)
    prompts = {f"p{i}": PREFIX + [60 + i] * 5 for i in range(6)}
    for rid, prompt in prompts.items():
        e.add_request(rid, prompt, 10)
    run_to_end(e)
    assert e.scheduler is not None
    assert e.preemptions > 0 and e.scheduler.stats.loads > 0
    assert e.scheduler.metrics.value("flushes_total") > 0
    for rid, req in e.requests.items():
        assert req.output == reference_outputs(prompts[rid], 10, VOCAB), rid


def test_a_block_overwritten_under_a_group_is_caught() -> None:
    e, _ = hybrid_engine(StepMode.SYNC, caching=True)
    req = e.add_request("a", PREFIX + [1, 2], 4)
    e.step()  # prefills 12 tokens
    assert req.groups is not None
    window_block = req.groups.tables[2][2]  # holds positions 8..11, read next step
    e.pool.data[window_block * e.pool.block_bytes] ^= 0xFF
    with pytest.raises(InvariantViolation, match="group 2 block"):
        e.step()
