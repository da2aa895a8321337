"""The simulator's numbers are consistent with each other and with the workload."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import pytest
from sim_helpers import CHUNK, CHUNK_BYTES, config, seg, simulate

from kvoffload.core.errors import UsageError
from kvoffload.engine.batcher import Batcher
from kvoffload.engine.block_pool import BlockPool
from kvoffload.engine.request import Request, Status
from kvoffload.engine.settings import EngineConfig
from kvoffload.engine.strategies import QueueScan, RegisterFull
from kvoffload.simulate.batching import RegisterNew, TrackedHolders
from kvoffload.simulate.chat import ChatTrace
from kvoffload.simulate.content import ContentHasher
from kvoffload.simulate.cost import CostModel
from kvoffload.simulate.report import SimResult, format_report
from kvoffload.simulate.request import SimRequest
from kvoffload.simulate.runner import SimConfig, Simulation, run_simulation
from kvoffload.simulate.trace import TraceRequest
from kvoffload.workload.chat import ChatWorkload


def chat(users: int = 12, turns: int = 4, concurrent: int = 6, rate: float = 20.0) -> ChatTrace:
    shape = ChatWorkload(users=users, turns=turns, system_tokens=96, output_tokens=24)
    return ChatTrace(dataclasses.replace(shape, user_tokens=(8, 40)), concurrent, rate)


def repeated(n: int = 20, tokens: int = 200) -> list[TraceRequest]:
    """``n`` distinct prompts, then the same ones again, well spaced in time."""
    first = [seg(float(i), (f"p{i}", tokens)) for i in range(n)]
    return first + [dataclasses.replace(r, t=r.t + 1000) for r in first]


def test_without_host_memory_nothing_hits_in_kvoffload() -> None:
    for cpu_bytes in (0, CHUNK_BYTES - 1):
        result = simulate(chat().requests(), cpu_bytes=cpu_bytes)
        assert result.requests == 48
        assert result.kvoffload_hit_tokens == result.avoided_tokens == 0
        assert result.tiers == []
        assert result.engine_hit_tokens > 0  # the engine's own prefix cache still works


def test_hits_never_exceed_prompt_tokens_even_under_preemption() -> None:
    # A small engine: requests are preempted and re-admitted.
    result = simulate(chat(users=24, concurrent=24, rate=1000.0).requests(), engine_tokens=1024)
    assert result.preemptions > 0
    assert result.kvoffload_hit_tokens > 0
    assert result.kvoffload_hit_tokens + result.engine_hit_tokens <= result.prompt_tokens
    assert 0 < result.hit_rate <= 1
    assert result.avoided_tokens == result.kvoffload_hit_tokens + result.readmission_hit_tokens


def test_a_repeated_trace_hits_nearly_fully_when_everything_fits() -> None:
    result = simulate(repeated(), prefix_caching=False)
    # The second pass loads every full chunk of every prompt (6 of 200 // 32 tokens);
    # the first pass cannot hit.
    assert result.kvoffload_hit_tokens == 20 * 6 * CHUNK
    assert result.tier("host") is not None
    # With the engine's prefix cache on and room for everything, the engine hits instead.
    on = simulate(repeated(), engine_tokens=16384)
    assert on.kvoffload_hit_tokens == 0
    assert on.engine_hit_tokens == 20 * (200 // 16) * 16


def test_traffic_is_chunks_times_chunk_bytes() -> None:
    result = simulate(chat().requests(), engine_tokens=1024)
    host = result.tier("host")
    assert host is not None and host.written > 0 and host.read > 0
    data = result.as_json()["tiers"][0]
    assert data["written_bytes"] == host.written * CHUNK_BYTES
    assert data["read_bytes"] == host.read * CHUNK_BYTES
    assert data["capacity_bytes"] == 1024 * CHUNK_BYTES
    # Every token loaded came from a loaded chunk.
    assert result.avoided_tokens <= host.read * CHUNK
    # Loads are costed on the host lane at its bandwidth.
    cost = result.cost
    assert result.load_s == pytest.approx(host.read * CHUNK_BYTES / (cost.host_gbps * 1e9))
    assert result.saved_s == pytest.approx(result.avoided_tokens * cost.prefill_s_per_token)


def test_capacity_limits_hits_and_counts_evictions() -> None:
    small = simulate(repeated(), prefix_caching=False, cpu_bytes=20 * CHUNK_BYTES)
    large = simulate(repeated(), prefix_caching=False)
    host = small.tier("host")
    assert host is not None and host.evictions > 0 and host.held_at_end <= 20
    assert small.kvoffload_hit_tokens < large.kvoffload_hit_tokens


@pytest.mark.parametrize("loads", ["direct", "promote"])
def test_a_disk_tier_below_a_small_host_tier_serves_hits(loads: str) -> None:
    """Tier loads (direct) serve the disk's hits with no deferral at all; promotions
    wait for the promotion first."""
    host_only = simulate(repeated(), prefix_caching=False, cpu_bytes=8 * CHUNK_BYTES)
    with_disk = simulate(
        repeated(),
        prefix_caching=False,
        cpu_bytes=8 * CHUNK_BYTES,
        tier_bytes={"disk": 512 * CHUNK_BYTES},
        lower_tier_loads=loads,
    )
    disk, host = with_disk.tier("disk"), with_disk.tier("host")
    assert disk is not None and disk.written > 0 and disk.read > 0
    assert (with_disk.deferrals.get("promotion", 0) > 0) == (loads == "promote")
    assert with_disk.kvoffload_hit_tokens > host_only.kvoffload_hit_tokens
    assert host is not None and host.evictions > 0 and host.evicted_without_copy == 0


def test_store_threshold_refuses_first_sightings() -> None:
    twice = simulate(repeated(), prefix_caching=False, store_threshold=2)
    assert twice.admission_refusals == 20 * 6  # every chunk, at its first sighting
    host = twice.tier("host")
    # Stored at the second sighting, so nothing was there to hit yet.
    assert host is not None and host.written == 20 * 6
    assert twice.kvoffload_hit_tokens == 0
    thrice = repeated() + [dataclasses.replace(r, t=r.t + 2000) for r in repeated()[20:]]
    assert simulate(thrice, prefix_caching=False, store_threshold=2).kvoffload_hit_tokens == (
        20 * 6 * CHUNK
    )


def test_compute_time_and_token_accounting_of_one_request() -> None:
    cost = CostModel(bytes_per_token=1024, prefill_s_per_token=1e-3, decode_s_per_token=1e-2)
    result = simulate([seg(2.0, ("p", 100), output=20)], cpu_bytes=0, cost=cost)
    assert result.computed_prefill_tokens == 100
    assert result.decode_tokens == 19  # the last token's KV is never computed
    assert result.simulated_s == pytest.approx(2.0 + 100e-3 + 19e-2)
    assert result.ttft_mean_s == pytest.approx(100e-3)


def test_results_are_deterministic() -> None:
    def run() -> dict[str, object]:
        data = simulate(
            chat().requests(), engine_tokens=1024, tier_bytes={"disk": 64 * CHUNK_BYTES}
        )
        data_json = data.as_json()
        del data_json["wall_s"]
        return data_json

    assert run() == run()


def test_a_request_larger_than_the_engine_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match=r"^test t=0: the request needs 5000 tokens"):
        simulate([seg(0, ("huge", 4990), output=10)], engine_tokens=4096)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"eviction": "fifo"}, "'eviction'"),
        ({"chunk_tokens": 24}, "'chunk_tokens'"),
        ({"store_threshold": 0}, "'store_threshold'"),
        ({"lower_tier_admission": "sometimes"}, "'lower_tier_admission'"),
        ({"decode_stride": 0}, "--decode-stride"),
        ({"cpu_bytes": 0, "tier_bytes": {"disk": 10 * CHUNK_BYTES}}, "below host memory"),
        ({"engine_tokens": 8}, "--engine-tokens"),
    ],
)
def test_bad_settings_name_the_option(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(Exception, match=message) as caught:
        config(**overrides)
    assert "\n" not in str(caught.value)


def test_the_fast_batch_former_decides_exactly_like_the_reference() -> None:
    settings = config(
        engine_tokens=768, tier_bytes={"disk": 32 * CHUNK_BYTES}, cpu_bytes=24 * CHUNK_BYTES
    )
    workload = chat(users=30, concurrent=30, rate=500.0)

    def run(plain: bool) -> tuple[object, ...]:
        sim = Simulation(settings)
        if plain:  # the reference engine's batch former and strategies
            e = sim.engine
            e.batcher = Batcher(e.config, e.pool, sim.scheduler)
        r = sim.run(workload.requests(), None)
        assert sim.scheduler is not None
        s, m = sim.scheduler.stats, sim.scheduler.metrics
        hit_tokens = m.value("hit_tokens_total", tier="host")
        stored = m.value("transferred_chunks_total", direction="store", tier="host")
        return (r.engine_steps, r.preemptions, r.simulated_s, hit_tokens, s.loads,
                stored, r.decode_tokens, r.computed_prefill_tokens, r.tiers)  # fmt: skip

    fast = run(plain=False)
    preemptions = fast[1]
    assert isinstance(preemptions, int) and preemptions > 10  # the holder scans mattered
    assert fast == run(plain=True)


def test_the_report_states_assumptions_and_results() -> None:
    result: SimResult = run_simulation(
        SimConfig(cpu_bytes=2**30, tier_bytes={"disk": 2**34}), chat().requests()
    )
    text = format_report(result)
    for needle in ("Assumptions", "prefill 50 us/token", "kvoffload hit rate", "host", "disk"):
        assert needle in text


def test_fast_paths_agree_with_the_reference_on_every_call() -> None:
    """Every holder scan and prefix-cache registration of the fast batch former is
    compared with the reference implementation on the same state, during a run with
    preemptions, loads and concurrent identical prefixes."""
    seen = {"holders": 0, "several_holders": 0, "cache": 0}

    class CheckedHolders(TrackedHolders):
        def idle(self, waiting: Sequence[Request]) -> list[Request]:
            mine = super().idle(waiting)
            assert mine == QueueScan().idle(waiting)
            seen["holders"] += bool(mine)
            seen["several_holders"] += len(mine) > 1
            return mine

        def loading(self, waiting: Sequence[Request]) -> bool:
            mine = super().loading(waiting)
            assert mine == QueueScan().loading(waiting)
            return mine

    class CheckedRegistration(RegisterNew):
        def register(self, req: Request) -> None:
            pool = self.pool
            before = (dict(pool.cached), list(pool.hash_of))
            RegisterFull(pool, self.block_size).register(req)
            reference = (dict(pool.cached), list(pool.hash_of))
            pool.cached, pool.hash_of = before
            super().register(req)
            assert (pool.cached, pool.hash_of) == reference
            seen["cache"] += 1

    settings = config(
        engine_tokens=640, cpu_bytes=16 * CHUNK_BYTES, tier_bytes={"disk": 64 * CHUNK_BYTES}
    )
    shape = ChatWorkload(users=40, turns=3, system_tokens=80, output_tokens=24)
    workload = ChatTrace(dataclasses.replace(shape, user_tokens=(8, 60)), 40, 2000.0, 2)
    sim = Simulation(settings)
    batcher = sim.engine.batcher
    batcher.holders = CheckedHolders()
    batcher.registration = CheckedRegistration(batcher.pool, settings.block_size)
    result = sim.run(workload.requests(), None)
    assert result.preemptions > 0 and result.avoided_tokens > 0
    assert seen["holders"] > 0 and seen["several_holders"] > 0 and seen["cache"] > 0


def test_a_block_skipped_as_a_duplicate_is_registered_once_the_original_is_gone() -> None:
    """Two requests computed the same prefix; only the first one's blocks were
    registered. When those are reused for other content, the reference registers the
    second request's copies at its next step; so must the fast path."""
    hasher = ContentHasher(16)
    engine = EngineConfig(num_blocks=6, block_size=16)
    pool = BlockPool(6, 16)
    registration = RegisterNew(pool, engine.block_size)
    first, second = (SimRequest(f"r{i}", seg(0, ("sys", 32)), i, hasher) for i in (0, 1))
    for req in (first, second):
        req.block_ids = pool.allocate(2) or []
        req.num_computed_tokens = 32
        req.status = Status.RUNNING
        registration.register(req)
    assert sorted(pool.cached.values()) == first.block_ids  # the second one was a duplicate
    pool.release(first.block_ids)
    assert pool.allocate(4) is not None  # takes the first request's blocks: hashes evicted
    assert pool.cached == {}
    registration.register(second)
    assert sorted(pool.cached.values()) == sorted(second.block_ids)


def test_holders_come_in_queue_order() -> None:
    """A preempted request re-queued at the front and then admitted with a load is the
    newest holder but the first in the queue: the scan answers in queue order."""
    hasher = ContentHasher(16)
    pool = BlockPool(8, 16)
    holders = TrackedHolders()
    older, newer = (SimRequest(f"r{i}", seg(0, (f"p{i}", 40)), i, hasher) for i in (0, 1))
    for req in (older, newer):
        req.block_ids = pool.allocate(2) or []
        req.status = Status.WAITING_FOR_LOAD
        holders.admitted(req)
        req.status = Status.WAITING  # its load landed
    waiting = [newer, older]
    assert holders.idle(waiting) == QueueScan().idle(waiting) == [newer, older]
