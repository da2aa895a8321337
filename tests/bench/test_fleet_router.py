"""The fleet routing benchmark's parts without engines or an indexer
(``bench/fleet_router.py``, ``bench/kv_front.py``, ``bench/event_tap.py``): the front's
scores, ties and round-robin; waiting for the indexer's credit; counting an event
stream's batches; the summary and its tables from made-up runs."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from tests.bench_modules import bench_module

kv_front = bench_module("kv_front")
event_tap = bench_module("event_tap")
fleet_router = bench_module("fleet_router")


def credit(**tiers: tuple[int, int]) -> dict[int, dict[str, int]]:
    """Worker ``w<i>`` -> (gpu, cpu) matched tokens, as the indexer answers."""
    return {int(w[1:]): {"gpu": g, "cpu": c, "disk": c} for w, (g, c) in tiers.items()}


def test_the_front_weighs_engine_memory_over_host_memory() -> None:
    assert kv_front.score({"gpu": 64, "cpu": 96}) == 64 + 0.75 * 32
    answer = credit(w1=(64, 64), w2=(0, 96))  # 64 vs 72: host memory of more tokens wins
    front = kv_front.Front([1, 2], lambda tokens: answer)
    route = front.route([1, 2, 3])
    assert route.engine == 1 and route.scores == (64.0, 72.0) and route.credit == answer
    answer = credit(w1=(96, 96), w2=(0, 96))
    assert front.route([1]).engine == 0
    assert front.sent == [1, 1]


def test_ties_go_to_the_engine_sent_fewest_then_round_robin() -> None:
    front = kv_front.Front([1, 2, 3], lambda tokens: credit(w1=(0, 32), w2=(0, 32), w3=(0, 0)))
    assert [front.route([1]).engine for _ in range(4)] == [0, 1, 0, 1]
    plain = kv_front.Front([1, 2, 3], lambda tokens: credit(w1=(0, 32), w2=(0, 0), w3=(0, 0)),
                           kv_aware=False)  # fmt: skip
    routes = [plain.route([1]) for _ in range(4)]
    assert [r.engine for r in routes] == [0, 1, 2, 0]
    assert routes[0].scores == (0.0, 0.0, 0.0) and routes[0].credit is not None
    assert [kv_front.Front([5, 6], None).route([1]).engine for _ in range(2)] == [0, 0]


def test_settled_waits_for_the_server_and_with_everyone_for_every_engine() -> None:
    answers = iter([credit(w1=(32, 32), w2=(0, 0)), credit(w1=(64, 64), w2=(0, 0)),
                    credit(w1=(64, 64), w2=(0, 64))])  # fmt: skip
    last: list[Any] = []

    def ask(tokens: list[int]) -> Any:
        last[:] = [next(answers, None) or last[0]]
        return last[0]

    tokens = list(range(70))  # two full blocks of 32
    assert kv_front.settled(ask, tokens, 1, [1, 2], block=32, everyone=True, within_s=5)
    answers = iter([credit(w1=(64, 64), w2=(0, 0))])
    assert kv_front.settled(ask, tokens, 1, [1, 2], block=32, everyone=False, within_s=5)
    assert not kv_front.settled(ask, tokens, 2, [1, 2], block=32, everyone=False, within_s=0)


def batch(*events: Any) -> bytes:
    return msgspec.msgpack.encode([1.0, list(events), None])


def stored(h: int, medium: str) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None,
            "token_ids": [h] * 32, "block_size": 32, "medium": medium}  # fmt: skip


def test_the_tally_counts_events_by_medium_and_tells_repeats() -> None:
    tally = event_tap.EventTally()
    tally.add(0, batch(stored(1, "GPU"), stored(1, "CPU")))
    tally.add(1, batch(stored(2, "CPU"), stored(1, "CPU")))  # 1 again: a repeat
    tally.add(2, batch({"type": "BlockRemoved", "block_hashes": [1], "medium": "CPU"}))
    tally.add(3, batch(stored(1, "CPU")))  # after its removal: news
    cpu = tally.of("CPU")
    assert cpu["stored"] == 4 and cpu["removed"] == 1 and cpu["repeats"] == 1
    assert cpu["events"] == 5 and cpu["bytes"] > 4 * 32
    assert tally.of("GPU")["stored"] == 1 and tally.of("STORAGE")["events"] == 0
    assert tally.batches == 4 and tally.complete
    tally.add(5, batch())
    assert not tally.complete
    late = event_tap.EventTally()
    late.add(3, batch())
    assert not late.complete


def a_run(config: str, r: int, ttft: float, per_engine: list[int]) -> dict[str, Any]:
    events = []
    for i, n in enumerate(per_engine):
        tally = event_tap.EventTally()
        tally.add(0, batch(*[stored(100 * i + k, "CPU") for k in range(n)]))
        events.append(fleet_router.events_of(tally, 10))
    return {"config": config, "round": r, "mean_ttft_s": ttft, "median_ttft_s": ttft,
            "hit_tokens": {"engine": 100, "host": 50, "disk": 0, "total": 150},
            "credited_at_routing": {"gpu": 90, "host": 40}, "routed": [3, 1],
            "identical": True, "settle_timeouts": 0, "stored_chunks": [6, 4],
            "events": events}  # fmt: skip


def test_the_summary_has_medians_ratios_and_events_per_chunk(
    capsys: pytest.CaptureFixture[str],
) -> None:
    runs = [
        a_run("round-robin", 1, 0.100, [10, 10]),
        a_run("indexer-own", 1, 0.080, [6, 4]),
        a_run("indexer-shared", 1, 0.050, [10, 10]),
        a_run("indexer-shared", 2, 0.070, [10, 12]),
        a_run("indexer-own", 2, 0.070, [6, 4]),
        a_run("round-robin", 2, 0.140, [10, 10]),
    ]
    summary = fleet_router.summarize(runs, 2)
    assert summary["indexer-shared"]["mean_ttft_s"] == pytest.approx(0.060)
    assert summary["ratios"]["indexer-shared/round-robin"]["by_round"] == pytest.approx([0.5, 0.5])
    assert summary["ratios"]["indexer-shared/indexer-own"]["median"] == pytest.approx(
        (0.050 / 0.080 + 1.0) / 2
    )
    assert summary["indexer-own"]["events_per_chunk"] == [0.6, 0.4]
    assert summary["indexer-shared"]["events_per_chunk"] == [1.0, 1.1]
    fleet_router.print_report(summary, 0.090, 2)
    out = capsys.readouterr().out
    assert "indexer-shared/indexer-own mean TTFT = 0.81x" in out
    assert "fleet 1.00; 10 chunks stored" in out and "fleet 2.10" in out
