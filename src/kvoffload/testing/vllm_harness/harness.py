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

Checked at every step (a violation raises :class:`HarnessViolation`):

- every forward pass reads exactly its request's own KV (``kv_model.py``);
- no store copy still running on a worker reads a block this step writes (the
  forward pass or a load): an unacknowledged store's source is never handed out
  without a flush;
- no load is planned for a request with jobs in flight;
- a load names only chunks stored or promoted since the last connector reset, a
  promotion only chunks spilled since then (nothing stored before a reset is served);
- the scheduler half's invariants hold, no internal error was caught at the engine
  boundary, no anomaly was counted (on vLLM, kvoffload's model of vLLM holds).
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvoffload.adapters.vllm.compat import KVConnectorRole
from kvoffload.adapters.vllm.connector import KVOffloadConnector
from kvoffload.adapters.vllm.messages import PlanMetadata, ReportMetadata
from kvoffload.adapters.vllm.scheduler_side import SchedulerSide
from kvoffload.adapters.vllm.worker_side import WorkerSide
from kvoffload.core.jobs import JobKind, JobResult, StepPlan, TransferJob, WorkerReport
from kvoffload.core.keys import ChunkKey
from kvoffload.core.scheduler import OffloadScheduler
from kvoffload.testing.vllm_harness.gates import CopyGate, GatedTiers
from kvoffload.testing.vllm_harness.kv_model import KVModel, ReadMismatch
from kvoffload.testing.vllm_harness.spec import HEAD_SIZE, HEADS, LAYERS, HarnessSpec, build_configs
from kvoffload.tiers.redis_index import RedisIndex
from kvoffload.transfer.worker import TransferWorker

SECONDS_PER_STEP = 0.02
"""The logical duration of one engine step (a step of a real engine takes 10-50 ms):
what the deferral bound in seconds and the Redis index's expiries are measured in."""


class HarnessViolation(AssertionError):
    """A check of the harness failed (see the module docstring)."""


class Completions(Protocol):
    """When transfers finish: per rank and step, which open jobs to release and which
    to fail, in which order the ranks run and how each report is ordered."""

    def copies(
        self, rank: int, step: int, jobs: Sequence[TransferJob]
    ) -> tuple[set[int], set[int]]: ...

    def tier_jobs(
        self, rank: int, step: int, jobs: Sequence[TransferJob]
    ) -> tuple[set[int], set[int]]: ...

    def rank_order(self, step: int, world_size: int) -> list[int]: ...

    def order(self, rank: int, step: int, results: list[JobResult]) -> list[JobResult]: ...


@dataclass
class CompleteAll:
    """Every job finishes in the step it was submitted (``release=False``: none does
    until a later policy says so); ``fail``: these job ids fail."""

    release: bool = True
    fail: set[int] = field(default_factory=set)

    def copies(
        self, rank: int, step: int, jobs: Sequence[TransferJob]
    ) -> tuple[set[int], set[int]]:
        ids = {j.job_id for j in jobs}
        return (ids - self.fail if self.release else set()), ids & self.fail

    tier_jobs = copies

    def rank_order(self, step: int, world_size: int) -> list[int]:
        return list(range(world_size))

    def order(self, rank: int, step: int, results: list[JobResult]) -> list[JobResult]:
        return results


@dataclass
class StepRecord:
    step: int
    plan: StepPlan
    scheduled: dict[str, int]
    preempted: set[str]
    finished_recving: set[str] = field(default_factory=set)
    invalid_blocks: set[int] = field(default_factory=set)

    def loads_for(self, request_id: str) -> list[TransferJob]:
        return [j for j in self.plan.loads if j.request_id == request_id]


@dataclass
class _Rank:
    rank: int
    connector: KVOffloadConnector
    side: WorkerSide
    copier: TransferWorker
    gate: CopyGate
    tiers: GatedTiers | None
    open_copies: dict[int, TransferJob] = field(default_factory=dict)


@dataclass
class _Executed:
    output: SchedulerOutput
    runner: ModelRunnerOutput
    record: StepRecord
    sampled: dict[str, int]


class VllmHarness:
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
        self.check_provenance = check_provenance
        self.expect_anomalies = expect_anomalies
        self.policy: Completions = CompleteAll()
        self._policy_saved: Completions | None = None
        self.trace: list[str] = []
        vllm_config, kv_cache_config = build_configs(self.spec, model_path)
        cls = AsyncScheduler if self.async_scheduling else Scheduler
        self.scheduler = cls(
            vllm_config, kv_cache_config, StructuredOutputManager(vllm_config), self.block_size
        )
        connector = self.scheduler.connector
        assert isinstance(connector, KVOffloadConnector) and connector.scheduler_side is not None
        self.connector = connector
        self.side: SchedulerSide = connector.scheduler_side
        self.side.scheduler.use_clock(lambda: self.clock)
        self._deterministic_redis_index()
        world = self.spec.world_size
        shape = (len(LAYERS), self.spec.num_blocks, HEADS, self.block_size, 2 * HEAD_SIZE)
        self.kv = [torch.zeros(shape, dtype=torch.float32) for _ in range(world)]
        self.model = KVModel(self.kv, self.block_size)
        self.ranks = [self._make_rank(r, vllm_config, kv_cache_config) for r in range(world)]
        self.aggregator = KVOutputAggregator(world) if world > 1 else None
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(self.block_size, sha256)
        self.tokens: dict[str, list[int]] = {}  # what the last step of each request read
        self.outputs: dict[str, list[int]] = {}  # the tokens the engine handed out
        self.steps: list[StepRecord] = []
        self.loads_checked = 0
        self._queue: deque[_Executed] = deque()
        self._jobs: dict[int, TransferJob] = {}
        self._loads: dict[str, tuple[TransferJob, set[int]]] = {}  # and blocks failed so far
        self._stored_since_reset: set[ChunkKey] = set()
        self._spilled_since_reset: set[ChunkKey] = set()

    # ------------------------------------------------------------ set-up

    def _deterministic_redis_index(self) -> None:
        """Swap the scheduler side's Redis index for one without its thread, in logical
        time (the harness answers its queries after each step)."""
        old = self.side.redis_index
        if old is None:
            return
        old.close()
        index = RedisIndex(
            old.client, old.digest, old.world_size, background=False, clock=lambda: self.clock
        )
        self.side.redis_index = index
        self.side.scheduler.tiers.tiers[index.name] = index

    def _make_rank(self, rank: int, vllm_config: object, kv_cache_config: object) -> _Rank:
        connector = KVOffloadConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)  # type: ignore[arg-type]
        side = connector.worker_side
        assert side is not None
        gate = CopyGate()
        side.copy_hook = gate
        side.rank_override = rank
        connector.register_kv_caches({name: self.kv[rank][i] for i, name in enumerate(LAYERS)})
        copier = side.worker
        assert copier is not None
        tiers = GatedTiers(side.tiers) if side.tiers is not None else None
        side.tiers = tiers
        entry = _Rank(rank, connector, side, copier, gate, tiers)
        store, load = copier.submit_store, copier.submit_load

        def submit_store(job: TransferJob) -> None:
            gate.submitted(job)
            entry.open_copies[job.job_id] = job
            store(job)

        def submit_load(job: TransferJob) -> None:
            gate.submitted(job)
            entry.open_copies[job.job_id] = job
            load(job)

        copier.submit_store = submit_store  # type: ignore[method-assign]
        copier.submit_load = submit_load  # type: ignore[method-assign]
        return entry

    # ------------------------------------------------------------ requests

    def add_request(
        self,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        salt: str | None = None,
        prompt_logprobs: int | None = None,
    ) -> None:
        params = SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=prompt_logprobs
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

    def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        """vLLM's reset; a successful reset of the connector changes the weights
        (the model's version): any KV from before would now be wrong."""
        done = bool(self.scheduler.reset_prefix_cache(reset_running_requests, reset_connector))
        if reset_connector:
            self._stored_since_reset.clear()
            self._spilled_since_reset.clear()
            if done:
                self.model.version += 1
        self.trace.append(
            f"! reset (running {reset_running_requests}, connector {reset_connector}) -> {done}"
        )
        return done

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

    def close(self) -> None:
        for entry in self.ranks:
            entry.gate.open()
            entry.connector.shutdown()
        self.connector.shutdown()

    def loaded_tokens(self, request_id: str) -> int:
        """Tokens kvoffload planned to load into the request's blocks so far."""
        return sum(
            len(j.block_ids) * self.block_size
            for j in self._jobs.values()
            if j.kind is JobKind.LOAD and j.request_id == request_id
        )

    def jobs_of(self, kind: JobKind) -> list[TransferJob]:
        return [j for j in self._jobs.values() if j.kind is kind]

    # ------------------------------------------------------------ one step

    def _schedule_and_execute(self) -> _Executed:
        output = self.scheduler.schedule()
        meta = output.kv_connector_metadata
        if not isinstance(meta, PlanMetadata):
            raise HarnessViolation(f"unexpected connector metadata {type(meta)}")
        plan = meta.plan
        self._check_plan(plan)
        record = StepRecord(
            len(self.steps) + 1,
            plan,
            dict(output.num_scheduled_tokens),
            set(output.preempted_req_ids or ()),
        )
        self.steps.append(record)
        self._trace_plan(record)
        self._inputs(output)
        sampled = self._sample(output)
        outputs: dict[int, ModelRunnerOutput] = {}
        for rank in self.policy.rank_order(record.step, len(self.ranks)):
            outputs[rank] = self._execute(self.ranks[rank], output, meta, sampled, record)
        if self.aggregator is not None:
            runner = self.aggregator.aggregate([outputs[r] for r in range(len(self.ranks))], 0)
            assert runner is not None
        else:
            runner = outputs[0]
        kv_out = runner.kv_connector_output
        if kv_out is not None:
            record.finished_recving = set(kv_out.finished_recving or ())
            record.invalid_blocks = set(kv_out.invalid_block_ids)
        self._check_landed_loads(record)
        return _Executed(output, runner, record, sampled)

    def _execute(
        self,
        entry: _Rank,
        output: SchedulerOutput,
        meta: PlanMetadata,
        sampled: dict[str, int],
        record: StepRecord,
    ) -> ModelRunnerOutput:
        """One rank's execute_model, in vLLM's order of connector calls."""
        plan, connector = meta.plan, entry.connector
        entry.gate.release(plan.flush)  # a flush waits for its jobs
        connector.handle_preemptions(meta)
        connector.bind_connector_metadata(meta)
        self._check_writes(entry, output, plan, record.step)
        self._forward(output, record.step, entry.rank)
        connector.start_load_kv(None)  # type: ignore[arg-type]
        connector.wait_for_save()
        self._complete(entry, record.step)
        results = connector.get_transfer_results(output.finished_req_ids)
        invalid = connector.get_block_ids_with_load_errors()
        worker_meta = connector.build_connector_worker_meta()
        connector.clear_connector_metadata()
        if isinstance(worker_meta, ReportMetadata):
            worker_meta = self._ordered(entry, record.step, worker_meta)
        ids = list(output.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=[[sampled[rid]] if rid in sampled else [] for rid in ids],
            kv_connector_output=KVConnectorOutput(
                finished_recving=results.finished_recving or None,
                invalid_block_ids=invalid,
                kv_connector_worker_meta=worker_meta,
            ),
        )

    def _complete(self, entry: _Rank, step: int) -> None:
        """Release and fail what the policy says, then wait until it finished."""
        jobs = [entry.open_copies[i] for i in sorted(entry.open_copies)]
        release, fail = self.policy.copies(entry.rank, step, jobs)
        entry.gate.release(release)
        entry.gate.fail(fail)
        if entry.tiers is not None:
            held = [entry.tiers.held[i] for i in sorted(entry.tiers.held)]
            release, fail = self.policy.tier_jobs(entry.rank, step, held)
            entry.tiers.fail(fail)
            entry.tiers.release(release)
            entry.tiers.inner.wait(entry.tiers.inner.running())
        entry.copier.wait(set(entry.open_copies) & entry.gate.let_through())

    def _ordered(self, entry: _Rank, step: int, meta: ReportMetadata) -> ReportMetadata:
        """The rank's report in a deterministic order (the policy's), and its finished
        copies forgotten."""
        reports = []
        for report in meta.reports:
            results = sorted(report.results, key=lambda r: r.job_id)
            for result in results:
                entry.open_copies.pop(result.job_id, None)
            reports.append(
                WorkerReport(report.rank, tuple(self.policy.order(entry.rank, step, results)))
            )
        return ReportMetadata(tuple(reports))

    def _apply(self, executed: _Executed) -> None:
        """The scheduler consumes one step's output; what it hands out as the
        requests' new tokens is what a user of the engine receives."""
        outputs = self.scheduler.update_from_output(executed.output, executed.runner)
        for engine_outputs in outputs.values():
            for out in engine_outputs.outputs:
                self.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)

    def _after_step(self) -> None:
        index = self.side.redis_index
        if index is not None:
            index.pump()
        self.check()

    # ------------------------------------------------------------ the model

    def _computed(self, output: SchedulerOutput) -> dict[str, int]:
        computed = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
        cached = output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        return computed

    def _inputs(self, output: SchedulerOutput) -> None:
        """The token ids this step computes over, as vLLM's model runner sees them:
        the request's tokens, plus (async) the token sampled by the step still in
        flight, which the scheduler has not applied yet."""
        computed = self._computed(output)
        in_flight = self._queue[0].sampled if self._queue else {}
        for request_id, count in output.num_scheduled_tokens.items():
            tokens = list(self.scheduler.requests[request_id].all_token_ids)
            end = computed[request_id] + count
            if len(tokens) < end and request_id in in_flight:
                tokens.append(in_flight[request_id])
            if len(tokens) < end:
                raise HarnessViolation(
                    f"{request_id!r}: positions up to {end} scheduled, {len(tokens)} tokens known"
                )
            self.tokens[request_id] = tokens

    def _sample(self, output: SchedulerOutput) -> dict[str, int]:
        """A token for every request whose scheduled positions end its known tokens
        (vLLM's model runner samples every request not in a partial prefill)."""
        sampled: dict[str, int] = {}
        computed = self._computed(output)
        for request_id, count in output.num_scheduled_tokens.items():
            if not self.scheduler.requests[request_id].is_prefill_chunk:
                tokens = self.tokens[request_id][: computed[request_id] + count]
                sampled[request_id] = self.model.sample(request_id, tokens)
        return sampled

    def _forward(self, output: SchedulerOutput, step: int, rank: int) -> None:
        """One rank's forward pass: every scheduled request reads its computed
        positions (checked) and writes the positions scheduled now."""
        computed = self._computed(output)
        for request_id, count in output.num_scheduled_tokens.items():
            tokens = self.tokens[request_id]
            blocks = self.scheduler.kv_cache_manager.get_block_ids(request_id)[0]
            start = computed[request_id]
            end = start + count
            try:
                self.model.check(
                    request_id, tokens, blocks, 0, start, what=f"step {step} forward", ranks=[rank]
                )
            except ReadMismatch as exc:
                raise HarnessViolation(str(exc)) from None
            self.model.write(request_id, tokens, blocks, start, end, ranks=[rank])

    # ------------------------------------------------------------ checks

    def _check_plan(self, plan: StepPlan) -> None:
        half = self.side.scheduler
        for job in (*plan.loads, *plan.stores, *plan.spills, *plan.promotions):
            self._jobs[job.job_id] = job
        for load in plan.loads:
            others = [
                j.job_id
                for j in half.jobs_in_flight()
                if j.request_id == load.request_id and j.job_id != load.job_id
            ]
            if others:
                raise HarnessViolation(
                    f"load {load.job_id} planned for {load.request_id!r} with jobs {others} "
                    "in flight"
                )
            if self.check_provenance:
                stale = [k for k in load.keys if k not in self._stored_since_reset]
                if stale:
                    raise HarnessViolation(
                        f"load {load.job_id} of {load.request_id!r} names {len(stale)} "
                        "chunks not stored since the last connector reset"
                    )
            if load.keys:
                self._loads[load.request_id] = (load, set())
        for promotion in plan.promotions:
            if self.check_provenance and not set(promotion.keys) <= self._spilled_since_reset:
                raise HarnessViolation(
                    f"promotion {promotion.job_id} names chunks not spilled since the last "
                    "connector reset"
                )
        for job in (*plan.stores, *plan.promotions):
            self._stored_since_reset.update(job.keys)
        for job in plan.spills:
            self._spilled_since_reset.update(job.keys)

    def _check_writes(
        self, entry: _Rank, output: SchedulerOutput, plan: StepPlan, step: int
    ) -> None:
        """No store copy still running on this rank reads a block this step writes."""
        written: set[int] = set()
        computed = self._computed(output)
        for request_id, count in output.num_scheduled_tokens.items():
            blocks = self.scheduler.kv_cache_manager.get_block_ids(request_id)[0]
            start = computed[request_id]
            end = start + count
            written.update(blocks[p // self.block_size] for p in range(start, end))
        for load in plan.loads:
            written.update(load.block_ids)
        running = entry.copier.running()
        for job_id in running:
            job = self._jobs.get(job_id)
            if job is None or job.kind is not JobKind.STORE:
                continue
            hit = written.intersection(job.block_ids)
            if hit:
                raise HarnessViolation(
                    f"step {step} rank {entry.rank}: store {job_id} of {job.request_id!r} still "
                    f"reads blocks {sorted(hit)} that this step writes (no flush)"
                )

    def _check_landed_loads(self, record: StepRecord) -> None:
        """A load reported done (and not failed) filled its blocks with the loading
        request's own KV."""
        for _, invalid in self._loads.values():
            invalid.update(record.invalid_blocks)  # a rank may report them before the end
        for request_id in record.finished_recving:
            entry = self._loads.pop(request_id, None)
            if entry is None or entry[1].intersection(entry[0].block_ids):
                continue
            job = entry[0]
            if request_id not in self.scheduler.requests:
                continue
            blocks = self.scheduler.kv_cache_manager.get_block_ids(request_id)[0]
            for block in job.block_ids:
                if block not in blocks:
                    continue
                start = blocks.index(block) * self.block_size
                try:
                    self.model.check(
                        request_id, self.tokens[request_id], blocks, start,
                        start + self.block_size, what=f"load {job.job_id}",
                    )  # fmt: skip
                except ReadMismatch as exc:
                    raise HarnessViolation(str(exc)) from None
            self.loads_checked += 1

    def check(self) -> None:
        """The invariants that hold after every step."""
        if self.side.guard.errors:
            raise HarnessViolation(
                "internal error at the vLLM boundary:\n" + self.side.guard.errors[0]
            )
        half = self.side.scheduler
        if half.anomalies.counts and not self.expect_anomalies:
            raise HarnessViolation(f"anomalies counted on vLLM: {half.anomalies.counts}")
        try:
            half.check_integrity()
        except AssertionError:
            raise
        except Exception as exc:
            raise HarnessViolation(f"integrity: {exc}") from None

    def quiescent(self) -> None:
        """Nothing left anywhere: every request gone, every pin, slot, job and engine
        block released."""
        half = self.side.scheduler
        problems = []
        if half.jobs_in_flight():
            problems.append(f"jobs in flight {[j.job_id for j in half.jobs_in_flight()]}")
        if half.request_ids():
            problems.append(f"requests tracked {half.request_ids()}")
        if half.directory.pinned_count or half.directory.storing_count:
            problems.append("host slots pinned or storing")
        for tier in half.tiers.directory_tiers():
            if tier.directory.pinned_count or tier.directory.storing_count:
                problems.append(f"{tier.name} slots pinned or storing")
        pool = self.scheduler.kv_cache_manager.block_pool
        if pool.get_num_free_blocks() != pool.num_gpu_blocks - 1:
            problems.append("engine blocks not freed")
        for entry in self.ranks:
            if entry.copier.running() or (entry.tiers is not None and entry.tiers.running()):
                problems.append(f"rank {entry.rank} still copying")
        if problems:
            raise HarnessViolation("not quiescent: " + "; ".join(problems))
        self.check()

    def _trace_plan(self, record: StepRecord) -> None:
        plan = record.plan
        sched = ", ".join(f"{r}+{n}" for r, n in record.scheduled.items()) or "-"
        line = f"step {record.step}: scheduled {sched}"
        if record.preempted:
            line += f"; preempted {sorted(record.preempted)}"
        self.trace.append(line)
        for job in (*plan.loads, *plan.stores, *plan.spills, *plan.promotions):
            where = f"blocks {list(job.block_ids)}" if job.kind.touches_engine else job.tier
            self.trace.append(
                f"    {job.kind.value} {job.job_id} {job.request_id or '-'}: "
                f"{len(job.keys)} chunks, {where}"
            )
        if plan.flush:
            self.trace.append(f"    flush {sorted(plan.flush)}")
