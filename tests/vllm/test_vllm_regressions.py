"""Regression tests on vLLM's real scheduler for the bugs of the vLLM fuzzer issue
and those the fuzzer found; each runs on the synchronous and the asynchronous
scheduler (really async: a batch queue of two). The harness checks every read of
every forward pass, so a wrong chunk anywhere fails these tests."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvoffload.adapters.vllm import scheduler_side
from kvoffload.core.jobs import JobKind, TransferJob
from kvoffload.core.observe.anomalies import Anomaly
from kvoffload.core.scheduler.request_state import Phase
from kvoffload.core.scheduler_types import ScheduledRequest, StepInput
from kvoffload.testing.redis_server import RedisServer
from kvoffload.testing.vllm_harness import CompleteAll, VllmHarness
from kvoffload.testing.vllm_harness.spec import HEAD_SIZE, HEADS, LAYERS
from kvoffload.tiers.disk import slot_bytes

MODES = [pytest.param(False, id="sync"), pytest.param(True, id="async")]
BLOCK = 16
CHUNK_BYTES = len(LAYERS) * HEADS * BLOCK * 2 * HEAD_SIZE * 4  # one block, all layers
DOC = list(range(10, 74))  # 64 tokens: 4 chunks of one block
FILLERS = [list(range(b, b + 64)) for b in (100, 200, 300)]


@dataclass
class HoldTiers(CompleteAll):
    """Engine copies complete at once; tier jobs of ``kinds`` only once ``hold`` is off."""

    hold: bool = True
    kinds: tuple[JobKind, ...] = (JobKind.SPILL, JobKind.PROMOTE)

    def tier_jobs(
        self, rank: int, step: int, jobs: Sequence[TransferJob]
    ) -> tuple[set[int], set[int]]:
        held = self.hold
        return {j.job_id for j in jobs if not (held and j.kind in self.kinds)}, set()


def tiers(tmp_path: Path, redis: RedisServer | None = None) -> dict[str, Any]:
    if redis is not None:
        return {"redis_url": redis.url, "redis_timeout_ms": 500}
    return {"disk_path": str(tmp_path / "disk"), "disk_bytes": 64 * slot_bytes(CHUNK_BYTES)}


def serve(h: VllmHarness, request_id: str, prompt: list[int], max_tokens: int = 2) -> None:
    h.add_request(request_id, prompt, max_tokens)
    h.run()


def push_below_host(h: VllmHarness) -> None:
    """DOC's chunks live only below host memory (at most 8 host slots), nowhere in
    the engine."""
    serve(h, "doc", DOC)
    for i, filler in enumerate(FILLERS):
        serve(h, f"filler{i}", filler)
    h.reset_prefix_cache()


# ------------------------------------------------------------ null and duplicate blocks (bug a)
# (sliding windows themselves are served now: tests/vllm/test_harness_groups.py)


@pytest.mark.parametrize("async_scheduling", MODES)
@pytest.mark.parametrize("damage", ["null", "duplicate"])
def test_null_and_duplicate_blocks_are_never_stored_and_nothing_raises(
    make: Any, monkeypatch: pytest.MonkeyPatch, async_scheduling: bool, damage: str
) -> None:
    """A sliding window puts vLLM's null block (id 0) into block tables; a table
    naming a block twice made JobTracker raise KeyError inside update_from_output.
    Fed such tables, kvoffload stores neither, counts them, and the engine runs on."""
    real = scheduler_side.step_input

    def damaged(output: Any) -> StepInput:
        step = real(output)
        out = []
        for s in step.scheduled:
            blocks = list(s.block_ids[0]) if s.block_ids else []
            if s.replace and len(blocks) >= 2:
                blocks[1] = 0 if damage == "null" else blocks[0]
            out.append(
                ScheduledRequest(
                    s.request_id,
                    s.num_computed_tokens,
                    s.num_scheduled_tokens,
                    (tuple(blocks),),
                    s.replace,
                )
            )
        return StepInput(tuple(out), step.preempted)

    monkeypatch.setattr(scheduler_side, "step_input", damaged)
    h = make(async_scheduling=async_scheduling, expect_anomalies=True)
    serve(h, "a", DOC, max_tokens=8)
    stores = h.jobs_of(JobKind.STORE)
    assert stores and all(0 not in j.block_ids for j in stores)
    assert all(len(set(j.block_ids)) == len(j.block_ids) for j in stores)
    kind = Anomaly.NULL_BLOCK if damage == "null" else Anomaly.DUPLICATE_BLOCK
    assert h.scheduler_half.anomalies.counts.get(kind, 0) >= 1
    assert h.output_tokens("a") == h.model.reference_output("a", DOC, 8)
    h.quiescent()


# ------------------------------------------------------------ skip_reading_prefix_cache (bug b)


@pytest.mark.parametrize("async_scheduling", MODES)
def test_a_prompt_logprobs_request_admitted_during_its_promotion_is_tracked(
    make: Any, tmp_path: Path, async_scheduling: bool
) -> None:
    """vLLM admits a request that skips reading the prefix cache whatever kvoffload
    answered. Looked up while the engine had no blocks for it, such a request had a
    promotion planned (PROMOTING); admitted while it ran, it stayed untracked, and
    its stores read chunk i from blocks at other positions: a later request loaded
    the wrong KV. Now lookup answers it 0 at once and its admission tracks it."""
    h = make(
        async_scheduling=async_scheduling,
        num_blocks=14,
        cpu_bytes=8 * CHUNK_BYTES,
        extra={**tiers(tmp_path), "lower_tier_loads": "promote"},  # the promotion path
    )
    push_below_host(h)
    policy = HoldTiers(kinds=(JobKind.PROMOTE,))
    h.policy = policy
    h.add_request("hog", list(range(700, 840)), 24)  # 9 of the 13 usable blocks
    h.step()
    tail = list(range(500, 540))
    h.add_request("c", DOC + tail, 2, prompt_logprobs=1)  # 7 blocks: no room yet
    half = h.scheduler_half
    while "hog" in h.scheduler.requests:
        record = h.step()
        assert record is None or "c" not in record.scheduled or half.state_of("c") is not None
    assert not [
        j for j in half.jobs_in_flight() if j.request_id == "c" and not j.kind.touches_engine
    ]
    for _ in range(4):
        record = h.step()
        if record is not None and "c" in record.scheduled:
            break
    c = half.state_of("c")
    assert c is not None and c.phase is Phase.RUNNING
    assert c.blocks[0] == list(h.scheduler.kv_cache_manager.get_block_ids("c")[0])
    policy.hold = False
    h.run()
    for i, filler in enumerate(FILLERS):  # c's chunks below host memory too
        serve(h, f"again{i}", filler)
    h.reset_prefix_cache()
    before = h.loads_checked
    serve(h, "d", DOC + tail + [9])  # served c's chunks: the harness checks every block
    assert h.loads_checked > before
    assert h.output_tokens("c") == h.model.reference_output("c", DOC + tail, 2)
    h.quiescent()


# ------------------------------------------------------------ connector reset (bug c)


@pytest.mark.parametrize("async_scheduling", MODES)
@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_a_connector_reset_makes_every_tier_unreadable_spills_in_flight_included(
    make: Any, tmp_path: Path, redis_server: RedisServer, async_scheduling: bool, tier: str
) -> None:
    h = make(
        async_scheduling=async_scheduling,
        cpu_bytes=4 * CHUNK_BYTES,
        extra=tiers(tmp_path, redis_server if tier == "redis" else None),
    )
    push_below_host(h)  # DOC is below host memory now
    policy = HoldTiers()
    h.policy = policy
    fresh = list(range(600, 664))
    h.add_request("b", fresh, 2)
    for _ in range(20):  # b runs; its chunks' spills are planned and held in flight
        h.step()
    spills = [j for j in h.scheduler_half.jobs_in_flight() if j.kind is JobKind.SPILL]
    assert "b" not in h.scheduler.requests and spills
    assert h.reset_prefix_cache(reset_connector=True)
    policy.hold = False
    h.run()
    half = h.scheduler_half
    assert len(half.directory) == 0
    found = half.tiers.tier(tier).metrics.value("hit_tokens_total")
    for request_id, prompt in (("doc2", DOC), ("b2", fresh)):
        serve(h, request_id, prompt)
        assert h.loaded_tokens(request_id) == 0
    assert (
        half.tiers.tier(tier).metrics.value("hit_tokens_total") == found
    )  # nothing found below either
    h.quiescent()


@pytest.mark.parametrize("async_scheduling", MODES)
def test_kv_computed_before_a_connector_reset_is_never_stored_after_it(
    make: Any, async_scheduling: bool
) -> None:
    """Found by the fuzzer: a request finished just before the reset had its final
    store planned after it, under the new keys: the old weights' KV was served."""
    h = make(async_scheduling=async_scheduling)
    h.add_request("a", DOC + [5], 16)
    while "a" in h.scheduler.requests:
        h.step(complete=False)  # its stores stay in flight
    assert h.reset_prefix_cache(reset_running_requests=True, reset_connector=True)
    stored_before = {j.job_id for j in h.jobs_of(JobKind.STORE)}
    h.run()
    assert not [j for j in h.jobs_of(JobKind.STORE) if j.job_id not in stored_before]
    serve(h, "a2", DOC + [5])  # the harness checks it reads nothing of the old weights
    assert h.loaded_tokens("a2") == 0
    h.quiescent()


@pytest.mark.parametrize("async_scheduling", MODES)
def test_a_request_preempted_while_its_promotion_runs_drains_it_first(
    make: Any, tmp_path: Path, async_scheduling: bool
) -> None:
    """Found by the fuzzer: admitted at its deferral bound while its promotion still
    ran, then preempted, the request went back to WAITING with the promotion in
    flight (and would be looked up on top of it)."""
    h = make(
        async_scheduling=async_scheduling,
        cpu_bytes=4 * CHUNK_BYTES,
        extra={
            **tiers(tmp_path),
            "max_deferral_steps": 2,
            "max_deferral_seconds": 0.1,
            "lower_tier_loads": "promote",
        },
    )
    push_below_host(h)
    policy = HoldTiers()
    h.policy = policy
    h.add_request("b", DOC + [7], 32)
    for _ in range(12):
        h.step()
    state = h.scheduler_half.state_of("b")
    promoting = [j for j in h.scheduler_half.jobs_of("b") if j.kind is JobKind.PROMOTE]
    assert state is not None and state.phase is Phase.RUNNING and promoting
    try:
        h.reset_prefix_cache(reset_running_requests=True)  # preempts b
    except RuntimeError:  # async: the step in flight still holds blocks; b is preempted
        assert async_scheduling
    h.step()
    assert state.phase is Phase.PREEMPTED_DRAINING
    policy.hold = False
    h.run()
    assert h.output_tokens("b") == h.model.reference_output("b", DOC + [7], 32)
    h.quiescent()


@pytest.mark.parametrize("async_scheduling", MODES)
def test_two_loads_on_window_groups_never_strand_the_engine(
    make: Any, async_scheduling: bool
) -> None:
    """Fuzzer seed 276: on a hybrid engine (windows 64, 100 and 40 and
    full attention, 60 blocks) two requests' loads landed in one idle step; vLLM had
    admitted the second, counting window groups' null blocks as held, and the first,
    at the head of its block holders, could not allocate the rest of its prefill,
    while the second, behind it, held the blocks: nothing ran again. kvoffload offers
    a hit on such an engine only while no other request's load is in flight."""
    chunk = 3 * BLOCK
    h = make(
        groups=(64, None, 100, 40),
        num_blocks=60,
        max_num_seqs=6,
        async_scheduling=async_scheduling,
        cpu_bytes=26 * 3 * CHUNK_BYTES,
        extra={"chunk_tokens": chunk, "eviction": "s3fifo", "max_deferral_steps": 27},
    )
    base = [(t * 37 + 11) % 997 for t in range(238)]
    prompts = {
        "r2": base,
        "r3": base[:117] + [(t * 53 + 5) % 991 for t in range(39)],
        "r5": base[:204] + [(t * 29 + 3) % 983 for t in range(34)],
    }
    h.add_request("r2", prompts["r2"], 33)
    for _ in range(25):
        h.step()
    h.add_request("r3", prompts["r3"], 33)
    h.step()
    h.step()
    h.add_request("r5", prompts["r5"], 33)
    h.run(limit=400)  # raised "not done after 400 steps" before the fix
    for request_id, prompt in prompts.items():
        expected = h.model.reference_output(request_id, prompt, 33)
        assert h.output_tokens(request_id) == expected
    assert h.loads_checked >= 2  # both later requests loaded their prefix
    h.quiescent()
