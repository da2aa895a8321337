"""What the scheduler half knows of its workers' weights (decision 0019): the state
machine, the key epoch it derives, the stamp a worker checks, and the scheduler
half's behaviour in each phase, driven call by call (no engine)."""

from __future__ import annotations

import pytest
from tests.unit.test_scheduler import BS, NS, Clock, Req

from kvoffload.core.directory import Directory
from kvoffload.core.errors import IllegalTransition
from kvoffload.core.identity.weights import (
    FENCED,
    TRANSITIONS,
    WeightsPhase,
    WeightsStamp,
    WeightsState,
    key_epoch,
    weights_digest,
)
from kvoffload.core.jobs import EngineJob, JobKind, JobResult, WorkerReport
from kvoffload.core.keys import chain_seed
from kvoffload.core.scheduler import OffloadScheduler
from kvoffload.core.scheduler_types import (
    RETRY_LATER,
    Deferral,
    ScheduledRequest,
    SchedulerConfig,
    StepInput,
)

A, B = b"a" * 16, b"b" * 16


def test_the_first_reports_of_every_rank_make_the_weights_known() -> None:
    w = WeightsState(2)
    assert w.phase is WeightsPhase.UNKNOWN and not w.known
    assert w.stamp() == WeightsStamp(0, None)
    assert w.report(0, 0, A) is None  # rank 1 has not reported
    change = w.report(1, 0, B)
    assert change is not None and change.first and change.changed
    assert w.known and w.fingerprints == (A, B)
    assert w.epoch == key_epoch(weights_digest((A, B)), b"")
    assert w.stamp() == WeightsStamp(0, (A, B))


def test_a_check_moves_to_checking_and_an_unchanged_answer_keeps_the_epoch() -> None:
    w = WeightsState(1)
    w.report(0, 0, A)
    epoch = w.epoch
    w.request_check()
    assert w.phase is WeightsPhase.CHECKING and w.check == 1
    assert w.stamp() == WeightsStamp(1, (A,))  # keys still name the known weights
    assert w.report(0, 0, B) is None  # an answer to an older check
    change = w.report(0, 1, A)
    assert change is not None and not change.changed and w.epoch == epoch


def test_changed_weights_change_the_epoch_and_a_repeated_check_waits_for_the_latest() -> None:
    w = WeightsState(1)
    w.report(0, 0, A)
    epoch = w.epoch
    w.request_check()
    w.request_check()
    assert w.report(0, 1, B) is None and w.phase is WeightsPhase.CHECKING
    change = w.report(0, 2, B)
    assert change is not None and change.changed and not change.first
    assert w.epoch != epoch and w.known


def test_a_worker_whose_weights_were_loaded_anew_reports_on_its_own() -> None:
    w = WeightsState(2)
    w.report(0, 0, A)
    w.report(1, 0, A)
    epoch = w.epoch
    assert w.report(1, 0, A) is None  # the same: nothing changes
    change = w.report(1, 0, B)
    assert change is not None and change.changed and w.fingerprints == (A, B)
    assert w.epoch != epoch


def test_a_connector_reset_changes_the_epoch_even_with_the_same_weights() -> None:
    w = WeightsState(1)
    w.report(0, 0, A)
    epoch = w.epoch
    w.reset(b"n" * 16)
    assert w.epoch != epoch and w.phase is WeightsPhase.CHECKING
    w.report(0, 1, A)
    assert w.epoch == key_epoch(weights_digest((A,)), b"n" * 16) != epoch


def test_fixed_weights_are_known_for_good_and_keep_the_original_keys() -> None:
    w = WeightsState(1, fixed=b"")
    w.request_check()
    assert w.known and w.epoch == b"" and w.report(0, 0, A) is None
    assert chain_seed(NS, w.epoch) == chain_seed(NS)
    w.reset(b"n" * 16)
    assert w.epoch == b"n" * 16  # a reset's random epoch, as before fingerprints


def test_reports_of_ranks_the_engine_does_not_have_are_ignored() -> None:
    w = WeightsState(1)
    assert w.report(3, 0, A) is None and w.report(-1, 0, A) is None
    assert w.phase is WeightsPhase.UNKNOWN


def test_only_the_table_s_moves_are_allowed() -> None:
    w = WeightsState(1)
    assert (WeightsPhase.KNOWN, WeightsPhase.UNKNOWN) not in TRANSITIONS
    w.report(0, 0, A)
    with pytest.raises(IllegalTransition):
        w._move(WeightsPhase.UNKNOWN)


@pytest.mark.parametrize(
    ("expected", "rank", "fingerprint", "allowed"),
    [
        (None, 0, A, False),
        ((A,), 0, A, True),
        ((A,), 0, B, False),
        ((A,), 1, A, False),
        ((A, B), 1, B, True),
    ],
)
def test_a_stamp_allows_only_the_weights_its_keys_name(
    expected: tuple[bytes, ...] | None, rank: int, fingerprint: bytes, allowed: bool
) -> None:
    assert WeightsStamp(0, expected).allows(rank, fingerprint) is allowed


# ---------------------------------------------------------------- the scheduler half


def make(**kw: object) -> tuple[OffloadScheduler, Clock]:
    clock = Clock()
    config = SchedulerConfig(block_size=BS, blocks_per_chunk=1, **kw)  # type: ignore[arg-type]
    weights = WeightsState(1)
    return OffloadScheduler(config, Directory(16), NS, clock=clock, weights=weights), clock


def store_prompt(s: OffloadScheduler, req: Req, blocks: list[int]) -> None:
    """Admit ``req`` with no hit, compute its prompt, complete its store."""
    assert s.lookup(req, 0) == 0
    s.on_allocated(req, (blocks,), 0)
    plan = s.build_plan(
        StepInput((ScheduledRequest(req.request_id, 0, len(req.tokens), (blocks,)),))
    )
    assert plan.stores
    s.on_report(WorkerReport(0, tuple(JobResult(j.job_id, True) for j in plan.stores)))
    s.on_finished(req.request_id)
    s.build_plan(StepInput(()))


def test_lookups_wait_until_the_weights_are_known_then_recompute_past_the_bound() -> None:
    s, clock = make(max_deferral_seconds=1.0)
    req = Req("r", list(range(8)))
    assert s.lookup(req, 0) is RETRY_LATER
    state = s.state_of("r")
    assert state is not None and state.deferred is not None
    assert state.deferred.reason is Deferral.WEIGHTS
    clock.now = 2.0  # nothing reported: past the bound the request recomputes
    assert s.lookup(req, 0) == 0
    s.on_allocated(req, ([1, 2],), 0)
    assert state.stale_kv  # computed with weights nobody identified: never stored
    plan = s.build_plan(StepInput((ScheduledRequest("r", 0, 8, ([1, 2],)),)))
    assert not plan.stores


def test_a_change_of_weights_hides_what_was_stored_and_stops_live_requests_storing() -> None:
    s, _ = make()
    s.on_weights(0, 0, A)
    old = Req("old", list(range(8)))
    store_prompt(s, old, [1, 2])
    again = Req("again", list(range(8)))
    assert s.lookup(again, 0) == 8  # a hit under the same weights
    running = Req("running", list(range(100, 108)))
    assert s.lookup(running, 0) == 0
    s.on_allocated(running, ([5, 6],), 0)
    s.check_weights()  # the prefix cache was reset
    # Answered under the last known weights meanwhile: the plan asking for the check
    # carries their fingerprints, and a worker whose weights changed refuses its loads.
    assert s.lookup(Req("waiting", list(range(8))), 0) == 8
    assert s.weights.stamp() == WeightsStamp(1, (A,))
    change = s.on_weights(0, 1, B)
    assert change is not None and change.changed
    assert s.lookup(Req("after", list(range(8))), 0) == 0  # other weights: a miss
    running_state = s.state_of("running")
    assert running_state is not None and running_state.stale_kv
    plan = s.build_plan(StepInput((ScheduledRequest("running", 0, 8, ([5, 6],)),)))
    assert not plan.stores  # its KV is the old weights'
    assert s.metrics.value("weights_changes_total") == 1
    assert s.metrics.value("weights_checks_total") == 1


def test_unchanged_weights_keep_their_chunks_across_a_prefix_cache_reset() -> None:
    s, _ = make()
    s.on_weights(0, 0, A)
    store_prompt(s, Req("old", list(range(8))), [1, 2])
    s.check_weights()
    assert s.on_weights(0, 1, A) is not None
    assert s.lookup(Req("after", list(range(8))), 0) == 8


def test_a_fenced_job_is_counted_by_direction() -> None:
    s, _ = make()
    s.on_weights(0, 0, A)
    req = Req("r", list(range(8)))
    assert s.lookup(req, 0) == 0
    s.on_allocated(req, ([1, 2],), 0)
    plan = s.build_plan(StepInput((ScheduledRequest("r", 0, 8, ([1, 2],)),)))
    store = plan.stores[0]
    assert isinstance(store, EngineJob) and store.kind is JobKind.STORE
    s.on_report(WorkerReport(0, (JobResult(store.job_id, False, error=FENCED),)))
    assert s.metrics.breakdown("fenced_jobs_total", "direction") == {"store": 1}
    assert s.lookup(Req("again", list(range(8))), 0) == 0  # never made readable
