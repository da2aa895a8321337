"""Drive vLLM's real Scheduler or AsyncScheduler with kvoffload, step by step.

Both connector roles are real ``KVOffloadConnector`` instances: the scheduler role is
the one vLLM's scheduler builds; one worker role per tensor-parallel rank copies
between that rank's real KV tensors (vLLM's CPU layout, all layers views of one
storage) and its real host slab, disk slab and Redis shards. Every copy waits in a
:class:`~kvoffload.testing.vllm_harness.gates.CopyGate` and every tier job in a
:class:`~kvoffload.testing.vllm_harness.gates.GatedTiers` until the
:class:`Completions` policy releases or fails it, so transfers complete when the
test says, never after a sleep; jobs a plan flushes are released first, as a real
flush waits for them.

Each call of :meth:`VllmHarness.step` is one call of vLLM's engine loop: ``step``
(sync) or ``step_with_batch_queue`` (async: the output of step N is applied after
step N+1 was scheduled). A scheduled step runs on every rank in vLLM's order
(``handle_preemptions``, the forward pass, ``start_load_kv``, ``wait_for_save``,
``get_transfer_results``, ``get_block_ids_with_load_errors``,
``build_connector_worker_meta``), and the ranks' outputs are merged by vLLM's own
``KVOutputAggregator``.

The engine has the KV cache groups ``HarnessSpec.groups`` names (full attention,
sliding windows), with vLLM's hybrid KV cache manager when there are several
(checked at start); the fake model writes and reads each group through its own
block table.

Checked at every step (``checks.py``; a violation raises :class:`HarnessViolation`):
every forward pass reads exactly its request's own KV, in every group what the
group's attention reads; no tier load reported timed out copies anything into engine
blocks afterwards (its read came back late); no store copy still running
reads a block the step writes; no load is planned for a request with jobs in flight;
loads and promotions name only chunks written since the last connector reset; the
scheduler half's invariants hold, and no internal error or anomaly was counted.
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvoffload.adapters.vllm.scheduler_side import SchedulerSide
from kvoffload.core.jobs import EngineJob, JobKind, TransferJob
from kvoffload.core.scheduler import OffloadScheduler
from kvoffload.testing.vllm_harness.checks import HarnessViolation
from kvoffload.testing.vllm_harness.completions import CompleteAll, Completions
from kvoffload.testing.vllm_harness.deferred_outputs import DeferredOutputs
from kvoffload.testing.vllm_harness.hangs import IoHangs, settle
from kvoffload.testing.vllm_harness.kv_model import KVModel, codec_tolerance
from kvoffload.testing.vllm_harness.model_runner import ModelRunner
from kvoffload.testing.vllm_harness.ranks import Rank, make_rank, plans_of, run_step
from kvoffload.testing.vllm_harness.records import StepRecord, plan_lines
from kvoffload.testing.vllm_harness.spec import (
    HEAD_SIZE,
    HEADS,
    LAYERS_PER_GROUP,
    HarnessSpec,
    build_configs,
)
from kvoffload.testing.vllm_harness.units import Unit, make_units
from kvoffload.testing.vllm_harness.weight_events import WeightEvents
from kvoffload.tiers.registry import LOWER_TIERS
from kvoffload.tiers.remote_index import RemoteIndex

SECONDS_PER_STEP = 0.02
"""The logical duration of one engine step (a step of a real engine takes 10-50 ms):
what the deferral bound in seconds, the Redis index's expiries and the cost model's
prefill speed are measured in (job timings are the spec's fixed ``lane_costs``)."""


@dataclass
class _Executed:
    output: SchedulerOutput
    runner: ModelRunnerOutput
    record: StepRecord
    sampled: dict[str, int]


class VllmHarness(WeightEvents):
    def __init__(
        self,
        model_path: Path,
        spec: HarnessSpec | None = None,
        *,
        check_provenance: bool = True,
        expect_anomalies: bool = False,
        **spec_fields: object,
    ) -> None:
        """``spec`` (or its fields as keywords, e.g. ``async_scheduling=True``).
        ``check_provenance``: lower tiers start empty (no chunk from an earlier run).
        ``expect_anomalies``: a test feeds surprising input on purpose (they are
        counted, not a violation)."""
        self.spec = spec if spec is not None else HarnessSpec(**spec_fields)  # type: ignore[arg-type]
        self.block_size = self.spec.block_size
        self.async_scheduling = self.spec.async_scheduling
        self.clock = 0.0  # logical seconds: SECONDS_PER_STEP per engine step
        self.policy: Completions = CompleteAll()
        self._policy_saved: Completions | None = None
        self.trace: list[str] = []
        vllm_config, kv_cache_config = build_configs(self.spec, model_path)
        cls = AsyncScheduler if self.async_scheduling else Scheduler
        self.scheduler = cls(
            vllm_config, kv_cache_config, StructuredOutputManager(vllm_config), self.block_size
        )
        world = self.spec.world_size
        shape = (LAYERS_PER_GROUP, self.spec.num_blocks, HEADS, self.block_size, 2 * HEAD_SIZE)
        self.kv = [torch.zeros(shape, dtype=torch.float32) for _ in range(world)]
        null = self.scheduler.kv_cache_manager.block_pool.null_block.block_id
        self.model = KVModel(self.kv, self.block_size, null)
        self.model.tolerance = codec_tolerance(self.spec.extra)
        self.units = make_units(
            self.scheduler,
            self.model,
            clock=lambda: self.clock,
            lane_costs=self.spec.lane_costs,
            check_provenance=check_provenance,
            expect_anomalies=expect_anomalies,
        )
        self.connector = self.units[-1].connector  # kvoffload under test
        self.side: SchedulerSide = self.units[-1].side
        self.published: list[object] = []  # vLLM KV events published (spec.kv_events)
        if self.spec.kv_events:
            self._capture_events()
        self.checks = self.units[-1].checks
        self.hangs = IoHangs()  # tier calls the test hangs inside their jobs
        self.ranks = [
            make_rank(
                r,
                vllm_config,
                kv_cache_config,
                self.kv[r],
                clock=lambda: self.clock,
                hangs=self.hangs,
                weights=self.model.fingerprint,
            )
            for r in range(world)
        ]
        self.handshake()
        self.outputs_in = DeferredOutputs(world)  # vLLM's aggregator; reports deferred
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(self.block_size, sha256)
        self.runner = ModelRunner(self.scheduler, self.model)
        if self.spec.kv_specs is None:
            self.runner.check_groups(self.spec.groups)
        self.tokens = self.runner.tokens  # what the last step of each request read
        self.outputs: dict[str, list[int]] = {}  # the tokens the engine handed out
        self.steps: list[StepRecord] = []
        self._queue: deque[_Executed] = deque()

    # ------------------------------------------------------------ requests

    def _capture_events(self) -> None:
        """Keep what the engine publishes, and drive the share announcer's rounds
        from the harness (deterministic: ``announce_watch.py``)."""
        publisher = self.scheduler.kv_event_publisher
        publisher.publish = lambda batch: self.published.extend(batch.events)  # type: ignore[method-assign,assignment]
        events = self.side.events
        if events is not None:
            events.sink.hold_s = 0.0
            if events.announcer is not None:
                events.announcer.stop_thread()

    def add_request(
        self,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        salt: str | None = None,
        prompt_logprobs: int | None = None,
        *,
        kv_transfer_params: Any = None,
    ) -> None:
        """Queue a request; ``kv_transfer_params`` reaches kvoffload as vLLM passes it
        (``SamplingParams.extra_args``, as the OpenAI server does)."""
        extra = None if kv_transfer_params is None else {"kv_transfer_params": kv_transfer_params}
        params = SamplingParams(
            max_tokens=max_tokens,
            ignore_eos=True,
            prompt_logprobs=prompt_logprobs,
            extra_args=extra,
        )
        request = Request(
            request_id, list(prompt), params, None, cache_salt=salt, block_hasher=self._hasher
        )
        self.tokens[request_id] = list(prompt)
        self.model.salts[request_id] = salt or ""
        self.scheduler.add_request(request)
        self.trace.append(f"+ {request_id}: {len(prompt)} tokens, max {max_tokens}")

    def abort(self, request_id: str) -> None:
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)
        self.trace.append(f"x abort {request_id}")

    def request(self, request_id: str) -> Request:
        return self.scheduler.requests[request_id]

    def output_tokens(self, request_id: str) -> list[int]:
        """The tokens the engine handed out for the request so far."""
        return list(self.outputs.get(request_id, []))

    # ------------------------------------------------------------ stepping

    def step(self, complete: bool = True, fail: set[int] | None = None) -> StepRecord | None:
        """One call of vLLM's engine loop; returns the step it scheduled, if any.
        ``complete``/``fail``: this step's completions (without them, ``policy``)."""
        if self._policy_saved is not None:
            self.policy, self._policy_saved = self._policy_saved, None
        if not complete or fail:  # this step only
            self._policy_saved = self.policy
            self.policy = CompleteAll(release=complete, fail=set(fail or ()))
        self.clock += SECONDS_PER_STEP
        record = None
        if self.async_scheduling:
            if self.scheduler.has_requests():
                executed = self._schedule_and_execute()
                record = executed.record
                self._queue.appendleft(executed)
                ran = executed.output.total_num_scheduled_tokens > 0
                if len(self._queue) < 2 and (ran or self.scheduler.has_requests()):
                    self._after_step()
                    return record
            elif not self._queue:
                return None
            self._apply(self._queue.pop())
        else:
            if not self.scheduler.has_requests():
                return None
            executed = self._schedule_and_execute()
            record = executed.record
            self._apply(executed)
        self._after_step()
        return record

    def busy(self) -> bool:
        return bool(self.scheduler.has_requests() or self._queue)

    def run(self, limit: int = 500) -> None:
        """Step until nothing is left to do (every transfer completing, unless the
        policy holds them)."""
        for _ in range(limit):
            if not self.busy():
                return
            self.step()
        raise HarnessViolation(f"not done after {limit} steps")

    @property
    def scheduler_half(self) -> OffloadScheduler:
        return self.side.scheduler

    def release_hangs(self) -> None:
        """Let every hung tier call return (and none hang from now on), wait until
        the lanes settled, and check the late returns wrote no engine block."""
        self.hangs.release_all()
        for entry in self.ranks:
            for child in entry.children:
                for lane in child.lanes():
                    settle(lane, entry.rank, self.hangs)
        self.checks.late_copies(self.ranks)

    def close(self) -> None:
        self.hangs.release_all()
        for entry in self.ranks:
            for child in entry.children:
                child.gate.open()
            entry.connector.shutdown()  # type: ignore[no-untyped-call]
        connector = self.scheduler.connector
        if connector is not None:
            connector.shutdown()  # type: ignore[no-untyped-call]

    @property
    def loads_checked(self) -> int:
        """Loads whose blocks were checked to hold the loading request's KV."""
        return sum(unit.checks.loads_checked for unit in self.units)

    def loaded_tokens(self, request_id: str) -> int:
        """Tokens kvoffload planned to load into the request's blocks so far (with
        several KV cache groups: summed over the groups, blocks left out included)."""
        loads = self.jobs_of(JobKind.LOAD)
        return sum(len(j.block_ids) * self.block_size for j in loads
                   if isinstance(j, EngineJob) and j.request_id == request_id)  # fmt: skip

    def jobs_of(self, kind: JobKind) -> list[TransferJob]:
        return [j for j in self.checks.jobs.values() if j.kind is kind]

    @property
    def beside(self) -> list[Unit]:
        """The kvoffload connectors beside the one under test (``spec.beside``)."""
        return self.units[:-1]

    def check(self) -> None:
        for unit in self.units:
            unit.checks.step()

    def quiescent(self) -> None:
        for unit in self.units:
            unit.checks.quiescent((e.rank, e.children[unit.index]) for e in self.ranks)

    # ------------------------------------------------------------ one step

    def _schedule_and_execute(self) -> _Executed:
        output = self.scheduler.schedule()
        meta = output.kv_connector_metadata
        if meta is None:
            raise HarnessViolation("no connector metadata")
        plans = [m.plan for m in plans_of(meta)]
        if len(plans) != len(self.units):
            raise HarnessViolation(f"{len(plans)} plans for {len(self.units)} connectors")
        for unit, unit_plan in zip(self.units, plans, strict=True):
            unit.checks.plan(unit_plan)
        plan = plans[-1]
        record = StepRecord(
            len(self.steps) + 1,
            plan,
            dict(output.num_scheduled_tokens),
            set(output.preempted_req_ids or ()),
            beside=tuple(plans[:-1]),
        )
        self.steps.append(record)
        self.trace.extend(plan_lines(record))
        self.runner.inputs(output, self._queue[0].sampled if self._queue else {})
        sampled = self.runner.sample(output)
        outputs: dict[int, ModelRunnerOutput] = {}
        ids = list(output.num_scheduled_tokens)
        for rank in self.policy.rank_order(record.step, len(self.ranks)):

            def forward(entry: Rank) -> None:
                written = set().union(*(self.runner.written(output, p) for p in plans))
                for unit in self.units:
                    child = entry.children[unit.index]
                    unit.checks.writes(entry.rank, child, written, record.step)
                self.runner.forward(output, record.step, entry.rank)

            kv_out = run_step(
                self.ranks[rank],
                meta,
                output.finished_req_ids,
                step=record.step,
                policy=self.policy,
                forward=forward,
            )
            outputs[rank] = ModelRunnerOutput(
                req_ids=ids,
                req_id_to_index={rid: i for i, rid in enumerate(ids)},
                sampled_token_ids=[[sampled[rid]] if rid in sampled else [] for rid in ids],
                kv_connector_output=kv_out,
            )
        runner = self.outputs_in.merge([outputs[r] for r in range(len(self.ranks))])
        merged = runner.kv_connector_output
        if merged is not None:
            record.finished_recving = set(merged.finished_recving or ())
            record.failed_recving = set(merged.failed_recving)
            record.invalid_blocks = set(merged.invalid_block_ids)
        for unit in self.units:
            unit.checks.landed(
                record.finished_recving, record.invalid_blocks, record.failed_recving
            )
        return _Executed(output, runner, record, sampled)

    def _apply(self, executed: _Executed) -> None:
        """The scheduler consumes one step's output; what it hands out as the
        requests' new tokens is what a user of the engine receives."""
        outputs = self.scheduler.update_from_output(executed.output, executed.runner)
        for engine_outputs in outputs.values():
            for out in engine_outputs.outputs:
                self.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)

    def _after_step(self) -> None:
        for unit in self.units:
            for spec in LOWER_TIERS:
                index = unit.side.lower_tier(spec.name)
                if isinstance(index, RemoteIndex):
                    index.pump()
        self.check()
        self.checks.late_copies(self.ranks)
