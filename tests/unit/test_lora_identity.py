"""LoRA adapters identified by the content vLLM loaded (decisions 0019 and 0025): the
scheduler half pins each ``lora_int_id`` to a digest the first time it meets it and
never reads the files again for it; workers report every load and refuse loads and
stores of requests keyed with another adapter than the one they hold; a load of other
contents under a pinned id turns offloading off for that id."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest

from kvoffload.adapters.vllm.lora_identity import AdapterDigests, LoraJob, LoraPins, LoraStamp
from kvoffload.adapters.vllm.messages import ReportMetadata
from kvoffload.adapters.vllm.worker_loras import WorkerLoras
from kvoffload.core.identity.content_digest import DigestCache
from kvoffload.core.identity.weights import FENCED, WeightsState
from kvoffload.core.jobs import EngineJob, JobKind, JobResult, StepPlan
from kvoffload.core.keys import ChunkKey, Namespace
from kvoffload.core.observe.anomalies import Anomaly, AnomalyLog
from kvoffload.core.observe.recorder import MetricsRecorder
from kvoffload.core.request_controls import DEFAULT, OFF, RequestControls
from kvoffload.core.scheduler.job_tracker import JobTracker
from kvoffload.core.scheduler.requests import RequestTable
from kvoffload.transfer.step_backend import TransferBackend
from kvoffload.transfer.worker import TransferWorker


@dataclass
class Lora:
    lora_name: str
    lora_path: str
    lora_int_id: int = 1


@dataclass
class Request:
    lora_request: Lora | None
    request_id: str = "r"


@dataclass
class Keys:
    extra: bytes


@dataclass
class State:
    request: Request
    keys: Keys = field(default_factory=lambda: Keys(b""))
    controls: RequestControls = DEFAULT


def adapter(path: Path, weights: bytes) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text('{"r": 8}')
    (path / "adapter_model.safetensors").write_bytes(weights)
    return path


@pytest.fixture
def digests(tmp_path: Path) -> AdapterDigests:
    return AdapterDigests(DigestCache(tmp_path / "cache"))


class Scheduler:
    """The scheduler half's side: live states and the pins over them."""

    def __init__(self, digests: AdapterDigests) -> None:
        self.states: dict[str, State] = {}
        self.metrics = MetricsRecorder()
        self.pins = LoraPins(self._iter, self.states.get, AnomalyLog(self.metrics), digests)

    def _iter(self) -> Iterator[State]:
        return iter(list(self.states.values()))

    def admit(self, request: Request) -> State:
        """A state as the request table makes it: keyed once, when created."""
        extra = self.pins.extra(request)
        state = State(request, Keys(extra or b""), OFF if extra is None else DEFAULT)
        self.states[request.request_id] = state
        return state


# ------------------------------------------------------------ digests


def test_a_request_without_an_adapter_adds_nothing(digests: AdapterDigests) -> None:
    assert Scheduler(digests).pins.extra(Request(None)) == b""


def test_an_adapter_rewritten_in_place_has_another_digest(
    tmp_path: Path, digests: AdapterDigests
) -> None:
    path = adapter(tmp_path / "a", b"\x01" * 4096)
    before = digests.digest("a", str(path))
    adapter(path, b"\x02" * 4096)  # same name, path and size
    assert before != digests.digest("a", str(path))


def test_copies_of_an_adapter_share_a_digest_whatever_their_name(
    tmp_path: Path, digests: AdapterDigests
) -> None:
    one = adapter(tmp_path / "one", b"\x03" * 100)
    two = adapter(tmp_path / "elsewhere" / "two", b"\x03" * 100)
    assert digests.digest("x", str(one)) == digests.digest("y", str(two))


def test_an_adapter_that_is_no_local_path_is_named_by_name_and_path(
    digests: AdapterDigests,
) -> None:
    hub = digests.digest("a", "org/adapter")
    assert hub and hub != digests.digest("b", "org/adapter")
    assert digests.signatures("org/adapter") == ["by name"]


# ------------------------------------------------------------ the scheduler half's pins


def test_an_id_is_keyed_with_what_it_first_held_whatever_happens_to_the_files(
    tmp_path: Path, digests: AdapterDigests
) -> None:
    """vLLM keeps the first contents loaded: so do the keys (the bug of issue 41)."""
    path = adapter(tmp_path / "a", b"\x01" * 64)
    before = digests.digest("a", str(path)).encode()
    sched = Scheduler(digests)
    first = sched.admit(Request(Lora("a", str(path)), "r1"))
    adapter(path, b"\x02" * 64)  # rewritten while vLLM holds the old one
    later = sched.admit(Request(Lora("a", str(path)), "r2"))
    assert first.keys.extra == later.keys.extra == before
    # Another id on the same path reads the files as they are now.
    other = sched.admit(Request(Lora("a", str(path), lora_int_id=2), "r3"))
    assert other.keys.extra == digests.digest("a", str(path)).encode() != first.keys.extra


def test_a_reload_of_the_same_contents_changes_nothing(
    tmp_path: Path, digests: AdapterDigests
) -> None:
    path = adapter(tmp_path / "a", b"\x01" * 64)
    sched = Scheduler(digests)
    state = sched.admit(Request(Lora("a", str(path))))
    sched.pins.learn([(0, 1, state.keys.extra.decode()), (1, 1, state.keys.extra.decode())])
    assert sched.pins.changed == set() and state.controls == DEFAULT


def test_a_load_of_other_contents_turns_offloading_off_for_that_id(
    tmp_path: Path, digests: AdapterDigests, caplog: pytest.LogCaptureFixture
) -> None:
    path = adapter(tmp_path / "a", b"\x01" * 64)
    sched = Scheduler(digests)
    live = sched.admit(Request(Lora("a", str(path)), "r1"))
    bystander = sched.admit(Request(Lora("b", str(path), lora_int_id=2), "r2"))
    plain = sched.admit(Request(None, "r3"))
    adapter(path, b"\x02" * 64)
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        sched.pins.learn([(0, 1, digests.digest("a", str(path)))])  # vLLM loaded it anew
    assert live.controls == OFF  # neither stored nor loaded from now on
    assert bystander.controls == DEFAULT and plain.controls == DEFAULT
    assert sched.pins.extra(Request(Lora("a", str(path)))) is None  # new ones too
    assert sched.metrics.value("anomalies_total", kind=Anomaly.LORA_CHANGED.value) == 1
    assert "lora_int_id" in caplog.text
    sched.pins.learn([(1, 1, "yet another")])  # counted once per id
    assert sched.metrics.value("anomalies_total", kind=Anomaly.LORA_CHANGED.value) == 1


def test_an_adapter_the_worker_loaded_first_is_pinned_to_what_it_loaded(
    tmp_path: Path, digests: AdapterDigests
) -> None:
    """vLLM's ``add_lora`` loads an id before any request names it."""
    path = adapter(tmp_path / "a", b"\x01" * 64)
    sched = Scheduler(digests)
    sched.pins.learn([(0, 1, "what the worker read")])
    assert sched.admit(Request(Lora("a", str(path)))).keys.extra == b"what the worker read"


def test_a_plan_names_the_digest_each_adapter_request_was_keyed_with(
    tmp_path: Path, digests: AdapterDigests
) -> None:
    path = adapter(tmp_path / "a", b"\x01" * 64)
    sched = Scheduler(digests)
    lora = sched.admit(Request(Lora("a", str(path)), "r1"))
    sched.admit(Request(None, "r2"))
    key = (ChunkKey(b"\x01" * 16),)
    store = EngineJob(1, JobKind.STORE, "r1", key, (0,), (3,), 1)
    other = EngineJob(2, JobKind.LOAD, "r2", key, (1,), (4,), 1)
    stamp = sched.pins.stamp(StepPlan(1, loads=(other,), stores=(store,)))
    assert stamp == LoraStamp((LoraJob("r1", 1, lora.keys.extra.decode(), "a", str(path)),))
    assert sched.pins.stamp(StepPlan(2, loads=(other,))) is None


def test_a_request_whose_identity_cannot_be_named_is_served_without_offloading() -> None:
    table = RequestTable(Namespace("m", "l", "d"), 1, JobTracker(1), MetricsRecorder(),
                         WeightsState(1))  # fmt: skip
    table.key_extra = lambda request: None
    assert table.new(cast(Any, Request(None))).controls == OFF


# ------------------------------------------------------------ the worker's loads and fence


class Manager:
    """vLLM's worker LoRA manager as the worker half sees it."""

    def __init__(self, during: Any = None) -> None:
        self.during = during  # called while "reading the files"
        self.loads: list[int] = []
        self.evicted: set[int] = set()

    def _load_adapter(self, lora_request: Lora) -> str:
        if self.during is not None:
            self.during()
        self.loads.append(lora_request.lora_int_id)
        return f"model {lora_request.lora_int_id}"

    def list_adapters(self) -> set[int]:
        return set(self.loads) - self.evicted


class Runner:
    def __init__(self, manager: Manager | None) -> None:
        if manager is not None:
            self.lora_manager = manager


def stamp(*jobs: tuple[str, int, str, Path]) -> LoraStamp:
    return LoraStamp(tuple(LoraJob(r, i, d, "a", str(p)) for r, i, d, p in jobs))


def plan(loads: tuple[str, ...] = (), stores: tuple[str, ...] = ()) -> StepPlan:
    key = (ChunkKey(b"\x01" * 16),)
    return StepPlan(
        1,
        loads=tuple(EngineJob(i, JobKind.LOAD, r, key, (0,), (1,), 1) for i, r in enumerate(loads)),
        stores=tuple(
            EngineJob(10 + i, JobKind.STORE, r, key, (0,), (1,), 1) for i, r in enumerate(stores)
        ),
    )


def test_a_worker_reports_what_it_loaded_and_runs_only_jobs_keyed_with_it(
    tmp_path: Path, digests: AdapterDigests
) -> None:
    path = adapter(tmp_path / "a", b"\x01" * 64)
    held = digests.digest("a", str(path))
    manager = Manager()
    loras = WorkerLoras(digests)
    loras.open(3, Runner(manager))
    assert manager._load_adapter(Lora("a", str(path))) == "model 1"  # vLLM's call, wrapped
    assert loras.take_reports() == ((3, 1, held),) and loras.take_reports() == ()
    both = stamp(("same", 1, held, path), ("other", 1, "another digest", path))
    assert loras.refused(both, plan(stores=("same", "other"))) == {"other"}
    assert loras.refused(None, plan(stores=("same",))) == frozenset()


def test_a_first_load_runs_when_the_files_give_its_digest_a_store_never(
    tmp_path: Path, digests: AdapterDigests
) -> None:
    """Before vLLM loaded an id (a restart's first hit): loads keyed with what the files
    hold now run; vLLM reads those files when the request runs."""
    path = adapter(tmp_path / "a", b"\x01" * 64)
    now = digests.digest("a", str(path))
    loras = WorkerLoras(digests)
    loras.open(0, Runner(Manager()))
    jobs = stamp(("hit", 1, now, path), ("old", 1, "before a rewrite", path), ("s", 1, now, path))
    assert loras.refused(jobs, plan(loads=("hit", "old"), stores=("s",))) == {"old", "s"}


def test_a_load_during_which_the_files_changed_matches_nothing(
    tmp_path: Path, digests: AdapterDigests
) -> None:
    path = adapter(tmp_path / "a", b"\x01" * 64)
    loras = WorkerLoras(digests)
    manager = Manager(during=lambda: adapter(path, b"\x02" * 64))
    loras.open(0, Runner(manager))
    manager._load_adapter(Lora("a", str(path)))
    ((_, _, loaded),) = loras.take_reports()
    assert loaded not in (digests.digest("a", str(path)),)
    jobs = stamp(("r", 1, digests.digest("a", str(path)), path))
    assert loras.refused(jobs, plan(stores=("r",))) == {"r"}


def test_an_id_loaded_with_two_contents_is_refused_for_good(
    tmp_path: Path, digests: AdapterDigests
) -> None:
    """A chunk computed partly with each contents is never stored, even under the
    digest of the contents loaded last."""
    path = adapter(tmp_path / "a", b"\x01" * 64)
    first = digests.digest("a", str(path))
    manager = Manager()
    loras = WorkerLoras(digests)
    loras.open(0, Runner(manager))
    manager._load_adapter(Lora("a", str(path)))
    adapter(path, b"\x02" * 64)
    manager._load_adapter(Lora("a", str(path)))  # evicted, then loaded anew
    adapter(path, b"\x01" * 64)
    manager._load_adapter(Lora("a", str(path)))  # and back
    assert [r[2] for r in loras.take_reports()][::2] == [first, first]
    assert loras.refused(stamp(("r", 1, first, path)), plan(stores=("r",))) == {"r"}
    assert manager.loads == [1, 1, 1]


def test_an_id_vllm_evicted_is_served_only_if_its_files_still_give_its_digest(
    tmp_path: Path, digests: AdapterDigests
) -> None:
    """vLLM loads an evicted id again from its files when the request runs: KV of the
    contents it held before is not loaded into a request the new files will compute."""
    path = adapter(tmp_path / "a", b"\x01" * 64)
    held = digests.digest("a", str(path))
    manager = Manager()
    loras = WorkerLoras(digests)
    loras.open(0, Runner(manager))
    manager._load_adapter(Lora("a", str(path)))
    manager.evicted = {1}  # another adapter took its place
    jobs = stamp(("load", 1, held, path), ("store", 1, held, path))
    both = plan(loads=("load",), stores=("store",))
    assert loras.refused(jobs, both) == {"store"}  # the files still hold it
    adapter(path, b"\x02" * 64)
    assert loras.refused(jobs, both) == {"load", "store"}
    manager.evicted = set()
    assert loras.refused(jobs, both) == frozenset()  # held: what vLLM loaded counts


def test_without_vllms_lora_manager_every_adapter_job_is_refused(
    tmp_path: Path, digests: AdapterDigests, caplog: pytest.LogCaptureFixture
) -> None:
    path = adapter(tmp_path / "a", b"\x01" * 64)
    loras = WorkerLoras(digests)
    loras.open(0, Runner(None))
    with caplog.at_level(logging.WARNING, logger="kvoffload"):
        jobs = stamp(("r", 1, digests.digest("a", str(path)), path))
        assert loras.refused(jobs, plan(loads=("r",))) == {"r"}
    assert "LoRA manager was not found" in caplog.text


def test_reports_of_every_worker_reach_the_scheduler_half() -> None:
    one = ReportMetadata(loras=((0, 1, "d"),))
    merged = one.aggregate(ReportMetadata(loras=((1, 1, "d"),)))
    assert isinstance(merged, ReportMetadata) and merged.loras == ((0, 1, "d"), (1, 1, "d"))


class Lane:
    """The transfer worker's calls the backend makes."""

    rank = 0

    def __init__(self) -> None:
        self.submitted: list[EngineJob] = []

    def submit_store(self, job: EngineJob) -> None:
        self.submitted.append(job)

    def wait(self, job_ids: Any, timeout: float | None = None) -> bool:
        return True

    def poll(self) -> list[JobResult]:
        return []


def test_the_backend_fails_a_refused_requests_jobs_at_once_and_runs_the_others() -> None:
    lane = Lane()
    backend = TransferBackend(cast(TransferWorker, lane), None, wait_for_loads=False)
    refused, kept = plan(stores=("refused", "kept")).stores
    backend.begin(StepPlan(1, stores=(refused, kept)))
    backend.refused_requests = {"refused": FENCED}
    backend.submit(refused)
    backend.submit(kept)
    assert lane.submitted == [kept]
    (report,) = backend.poll()
    assert report.results == (JobResult(refused.job_id, False, error=FENCED),)
