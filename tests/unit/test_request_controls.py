"""Per-request controls (``kv_transfer_params["kvoffload"]``): parsed without ever
raising, and obeyed by lookup and stores."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from tests.unit.test_scheduler import BS, Req, ok

from kvoffload.core.directory import Directory
from kvoffload.core.keys import Namespace
from kvoffload.core.observe.metrics_view import read_metrics
from kvoffload.core.request_controls import DEFAULT, OFF, RequestControls, parse_controls
from kvoffload.core.scheduler import OffloadScheduler
from kvoffload.core.scheduler_types import ScheduledRequest, SchedulerConfig, StepInput

NS = Namespace("m", "layout", "f32")


@dataclass
class ParamReq(Req):
    kv_transfer_params: Any = None


@pytest.mark.parametrize(
    ("params", "controls"),
    [
        (None, DEFAULT),
        ({}, DEFAULT),
        ({"do_remote_prefill": True}, DEFAULT),  # another connector's keys
        ({"kvoffload": {}}, DEFAULT),
        ({"kvoffload": {"store": False}}, RequestControls(store=False)),
        ({"kvoffload": {"load": False}}, RequestControls(load=False)),
        ({"kvoffload": {"load": "always"}}, RequestControls(load_policy="always")),
        ({"kvoffload": {"load": "cost"}}, RequestControls(load_policy="cost")),
        ({"kvoffload": {"max_store_tokens": 64}}, RequestControls(max_store_tokens=64)),
        ({"kvoffload": {"max_load_tokens": 0}}, RequestControls(max_load_tokens=0)),
        (
            {"kvoffload": {"load_tiers": ["host", "disk"]}},
            RequestControls(load_tiers=frozenset({"host", "disk"})),
        ),
    ],
)
def test_valid_controls(params: Any, controls: RequestControls) -> None:
    assert parse_controls(params) == (controls, None)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ("store=false", "kv_transfer_params"),
        ({"kvoffload": "off"}, "kvoffload"),
        ({"kvoffload": {"store": "no"}}, "kvoffload.store"),
        ({"kvoffload": {"load": 0}}, "kvoffload.load"),
        ({"kvoffload": {"load": "never"}}, "kvoffload.load"),
        ({"kvoffload": {"max_load_tokens": -1}}, "kvoffload.max_load_tokens"),
        ({"kvoffload": {"max_store_tokens": 1.5}}, "kvoffload.max_store_tokens"),
        ({"kvoffload": {"max_store_tokens": True}}, "kvoffload.max_store_tokens"),
        ({"kvoffload": {"load_tiers": "disk"}}, "kvoffload.load_tiers"),
        ({"kvoffload": {"load_tiers": ["ssd"]}}, "kvoffload.load_tiers"),
        ({"kvoffload": {"max_tokens": 5}}, "kvoffload.max_tokens"),
        ({"kvoffload": {1: 5}}, "kvoffload.1"),
    ],
)
def test_a_bad_value_turns_offloading_off_for_the_request_and_names_the_field(
    params: Any, field: str
) -> None:
    assert parse_controls(params) == (OFF, field)


def make(slots: int = 32) -> OffloadScheduler:
    config = SchedulerConfig(block_size=BS, blocks_per_chunk=1)
    return OffloadScheduler(config, Directory(slots), NS)


def prefill(s: OffloadScheduler, req: Req, blocks: list[int]) -> int:
    """Admit ``req`` (no hit), compute its prompt, finish it; the chunks stored."""
    assert s.lookup(req, 0) == 0
    s.on_allocated(req, (blocks,), 0)
    req.num_computed_tokens = req.num_tokens
    plan = s.build_plan(
        StepInput((ScheduledRequest(req.request_id, 0, req.num_tokens, (tuple(blocks),), True),))
    )
    s.on_report(ok(plan.stores))
    s.on_finished(req.request_id)
    final = s.build_plan(StepInput())
    s.on_report(ok(final.stores))
    return sum(len(job.keys) for job in (*plan.stores, *final.stores))


def test_store_false_stores_nothing_and_max_store_tokens_a_prefix() -> None:
    s = make()
    private = ParamReq("p", list(range(16)), kv_transfer_params={"kvoffload": {"store": False}})
    assert prefill(s, private, [1, 2, 3, 4]) == 0
    assert s.lookup(Req("q", list(range(16))), 0) == 0  # nothing of it is readable
    capped = ParamReq(
        "c", list(range(16)), kv_transfer_params={"kvoffload": {"max_store_tokens": 9}}
    )
    assert prefill(s, capped, [5, 6, 7, 8]) == 2  # chunks within the first 9 tokens
    assert s.lookup(Req("r", list(range(16))), 0) == 8
    s.check_integrity()


def test_load_false_and_max_load_tokens_limit_what_lookup_offers() -> None:
    s = make()
    assert prefill(s, Req("a", list(range(16))), [1, 2, 3, 4]) == 4
    no_load = ParamReq("n", list(range(16)), kv_transfer_params={"kvoffload": {"load": False}})
    assert s.lookup(no_load, 0) == 0
    capped = ParamReq(
        "m", list(range(16)), kv_transfer_params={"kvoffload": {"max_load_tokens": 11}}
    )
    assert s.lookup(capped, 0) == 8
    assert s.lookup(Req("x", list(range(16))), 0) == 16
    s.check_integrity()


def test_a_bad_value_is_counted_by_field_and_the_request_is_served_without_offloading() -> None:
    s = make()
    assert prefill(s, Req("a", list(range(16))), [1, 2, 3, 4]) == 4
    bad = ParamReq("b", list(range(16)), kv_transfer_params={"kvoffload": {"load": "yes"}})
    assert s.lookup(bad, 0) == 0
    again = ParamReq("c", list(range(16)), kv_transfer_params={"kvoffload": {"load": "yes"}})
    assert prefill(s, again, [5, 6, 7, 8]) == 0  # neither loaded nor stored
    reading = read_metrics(s, 1)
    key = ("request_param_errors_total", (("field", "kvoffload.load"),))
    assert reading.counters[key] == 2
    s.check_integrity()
