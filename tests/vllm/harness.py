"""Drive vLLM's real Scheduler / AsyncScheduler with kvoffload's connector, step by step.

Both connector roles are real ``KVOffloadConnector`` instances; the worker role
copies between real KV tensors (vLLM's CPU layout, all layers views of one storage)
and a real host slab. Every copy passes a :class:`Gate` first, so transfer jobs
complete (or fail) only when the test says so; jobs the plan flushes are let through
(together with the stores queued before them), as a real flush waits for them.

The "model" writes, for every computed token position, a value derived from the
request's tokens up to that position (so equal prefixes have equal KV, like a real
model), and samples deterministic tokens. When a load lands, the harness checks the
loaded blocks hold exactly the KV of the loading request's tokens.

In async mode the scheduler's ``update_from_output`` for step N runs after step N+1
was scheduled, like vLLM's batch queue.
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from kvoffload.adapters.vllm.compat import KVConnectorRole
from kvoffload.adapters.vllm.connector import KVOffloadConnector
from kvoffload.adapters.vllm.messages import PlanMetadata
from kvoffload.core.jobs import JobKind, StepPlan, TransferJob

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


class Gate:
    """A copy hook that holds every job until the test allows (or fails) it."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._allowed: set[int] = set()
        self._failing: set[int] = set()
        self._open = False
        self.seen: list[int] = []

    def __call__(self, job: TransferJob) -> None:
        with self._cv:
            self.seen.append(job.job_id)
            self._cv.wait_for(
                lambda: self._open or job.job_id in self._allowed or job.job_id in self._failing
            )
            fail = job.job_id in self._failing
        if fail:
            raise RuntimeError(f"injected failure of job {job.job_id}")

    def allow(self, job_ids: set[int]) -> None:
        with self._cv:
            self._allowed |= job_ids
            self._cv.notify_all()

    def fail(self, job_ids: set[int]) -> None:
        with self._cv:
            self._failing |= job_ids
            self._cv.notify_all()

    def open(self) -> None:
        with self._cv:
            self._open = True
            self._cv.notify_all()


@dataclass
class StepRecord:
    step: int
    plan: StepPlan
    scheduled: dict[str, int]
    preempted: set[str]
    finished_recving: set[str]
    invalid_blocks: set[int]

    def loads_for(self, request_id: str) -> list[TransferJob]:
        return [j for j in self.plan.loads if j.request_id == request_id]


@dataclass
class _Pending:
    output: SchedulerOutput
    runner: ModelRunnerOutput
    sampled: dict[str, int] = field(default_factory=dict)


def _kv_value(tokens: list[int], position: int, layer: int) -> float:
    digest = hashlib.blake2b(repr(tokens[: position + 1]).encode(), digest_size=4).digest()
    return float(int.from_bytes(digest[:3], "little") + layer)


class VllmHarness:
    def __init__(
        self,
        model_path: Path,
        *,
        async_scheduling: bool = False,
        num_blocks: int = 32,
        block_size: int = 16,
        cpu_bytes: int = 1 << 20,
        extra: dict[str, object] | None = None,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 64,
    ) -> None:
        self.block_size = block_size
        self.async_scheduling = async_scheduling
        spec = FullAttentionSpec(
            block_size=block_size, num_kv_heads=2, head_size=8, dtype=torch.float32
        )
        page = spec.page_size_bytes
        kv_cache_config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[
                KVCacheTensor(
                    size=page * num_blocks * len(LAYERS),
                    layers=list(LAYERS),
                    layer_stride=page * num_blocks,
                    block_stride=page,
                )
            ],
            kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)],
        )
        vllm_config = VllmConfig(
            model_config=ModelConfig(
                model=str(model_path), dtype="float32", max_model_len=2048, skip_tokenizer_init=True
            ),
            cache_config=CacheConfig(block_size=block_size, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(
                max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=2048,
                is_encoder_decoder=False,
                async_scheduling=async_scheduling,
            ),
            kv_transfer_config=KVTransferConfig(
                kv_connector="KVOffloadConnector",
                kv_connector_module_path="kvoffload.vllm",
                kv_role="kv_both",
                kv_connector_extra_config={"cpu_bytes": cpu_bytes, **(extra or {})},
            ),
        )
        vllm_config.cache_config.num_gpu_blocks = num_blocks
        scheduler_cls = AsyncScheduler if async_scheduling else Scheduler
        self.scheduler = scheduler_cls(
            vllm_config, kv_cache_config, StructuredOutputManager(vllm_config), block_size
        )
        connector = self.scheduler.connector
        assert isinstance(connector, KVOffloadConnector)
        self.connector = connector
        self.worker = KVOffloadConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        self.gate = Gate()
        assert self.worker.worker_side is not None
        self.worker.worker_side.copy_hook = self.gate
        # vLLM's CPU layout: [num_blocks, heads, block_size, 2 * head_size] per layer,
        # all layers views of one storage.
        self.kv = torch.zeros(len(LAYERS), num_blocks, 2, block_size, 16, dtype=torch.float32)
        self.worker.register_kv_caches({name: self.kv[i] for i, name in enumerate(LAYERS)})
        init_none_hash(sha256)
        self._hasher = get_request_block_hasher(block_size, sha256)
        self.tokens: dict[str, list[int]] = {}
        self._open_jobs: set[int] = set()
        self.loads_checked = 0
        self._pending: _Pending | None = None
        self._loads: dict[str, TransferJob] = {}
        self.steps: list[StepRecord] = []

    # ------------------------------------------------------------ requests

    def add_request(
        self, request_id: str, prompt: list[int], max_tokens: int, salt: str | None = None
    ) -> None:
        request = Request(
            request_id,
            list(prompt),
            SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            None,
            cache_salt=salt,
            block_hasher=self._hasher,
        )
        self.tokens[request_id] = list(prompt)
        self.scheduler.add_request(request)

    def abort(self, request_id: str) -> None:
        self.scheduler.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)

    def request(self, request_id: str) -> Request:
        return self.scheduler.requests[request_id]

    def output_tokens(self, request_id: str) -> list[int]:
        return self.tokens[request_id][
            len(self.scheduler.requests[request_id].prompt_token_ids or []) :
        ]

    # ------------------------------------------------------------ stepping

    def step(self, complete: bool = True, fail: set[int] | None = None) -> StepRecord:
        """One engine step. ``complete``: every job submitted so far may finish;
        ``fail``: these job ids fail. Flushed jobs always run before the forward."""
        output = self.scheduler.schedule()
        meta = output.kv_connector_metadata
        assert isinstance(meta, PlanMetadata)
        plan = meta.plan
        for job in plan.loads:
            self._loads[job.request_id] = job
        self._open_jobs |= {j.job_id for j in (*plan.loads, *plan.stores)}
        if plan.flush:
            # A flush waits for its jobs, and each direction runs in order.
            self.gate.allow({j for j in self._open_jobs if j <= max(plan.flush)})
        worker = self.worker
        worker.handle_preemptions(meta)
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)  # type: ignore[arg-type]
        sampled = self._forward(output)
        worker.wait_for_save()
        if fail:
            self.gate.fail(fail)
        if complete:
            self.gate.allow(set(self._open_jobs))
        self._transfer_worker().wait(set(self._open_jobs) if complete else (fail or set()))
        _, finished_recving = worker.get_finished(output.finished_req_ids)
        invalid = worker.get_block_ids_with_load_errors()
        worker_meta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        if worker_meta is not None:
            for report in worker_meta.reports:  # type: ignore[attr-defined]
                self._open_jobs -= {r.job_id for r in report.results}
        ids = list(output.num_scheduled_tokens)
        runner = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=[[sampled[rid]] if rid in sampled else [] for rid in ids],
            kv_connector_output=KVConnectorOutput(
                finished_recving=finished_recving,
                invalid_block_ids=invalid,
                kv_connector_worker_meta=worker_meta,
            ),
        )
        for request_id in finished_recving or ():
            if request_id in self._loads and not invalid:
                self._check_load(self._loads.pop(request_id))
        current = _Pending(output, runner, sampled)
        if self.async_scheduling:
            previous, self._pending = self._pending, current
            if previous is not None:
                self._apply(previous, in_flight=current)
        else:
            self._apply(current, in_flight=None)
        record = StepRecord(
            len(self.steps) + 1,
            plan,
            dict(output.num_scheduled_tokens),
            set(output.preempted_req_ids or ()),
            set(finished_recving or ()),
            invalid,
        )
        self.steps.append(record)
        return record

    def run(self, limit: int = 200) -> None:
        """Step with every transfer completing until nothing is left to do."""
        for _ in range(limit):
            if not self.scheduler.has_unfinished_requests():
                if self._pending is not None:
                    pending, self._pending = self._pending, None
                    self._apply(pending, in_flight=None)
                    continue
                if not self.connector.has_pending_push_work():
                    return
            self.step()
        raise AssertionError(f"not done after {limit} steps")

    @property
    def scheduler_half(self):  # type: ignore[no-untyped-def]
        assert self.connector.scheduler_side is not None
        return self.connector.scheduler_side.scheduler

    def close(self) -> None:
        self.gate.open()
        self.worker.shutdown()

    # ------------------------------------------------------------ internals

    def _transfer_worker(self):  # type: ignore[no-untyped-def]
        assert self.worker.worker_side is not None and self.worker.worker_side.worker is not None
        return self.worker.worker_side.worker

    def _apply(self, pending: _Pending, in_flight: _Pending | None) -> None:
        """The scheduler consumes ``pending``'s output. The harness's token lists
        become the scheduler's own plus what the still unapplied step sampled."""
        self.scheduler.update_from_output(pending.output, pending.runner)
        for request_id in pending.sampled:
            request = self.scheduler.requests.get(request_id)
            if request is None:
                continue
            later = in_flight.sampled.get(request_id) if in_flight is not None else None
            self.tokens[request_id] = list(request.all_token_ids) + (
                [later] if later is not None else []
            )

    def _forward(self, output: SchedulerOutput) -> dict[str, int]:
        """Write KV for every scheduled position; sample where a request's known
        tokens are all computed."""
        sampled: dict[str, int] = {}
        computed = {new.req_id: new.num_computed_tokens for new in output.scheduled_new_reqs}
        cached = output.scheduled_cached_reqs
        computed.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for request_id, count in output.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            tokens = self.tokens[request_id]
            blocks = self.scheduler.kv_cache_manager.get_block_ids(request_id)[0]
            start = computed[request_id]
            for position in range(start, start + count):
                if position >= len(tokens):
                    break
                block = blocks[position // self.block_size]
                for layer in range(len(LAYERS)):
                    self.kv[layer, block, :, position % self.block_size, :] = _kv_value(
                        tokens, position, layer
                    )
            if start + count >= len(tokens) and len(tokens) - len(
                request.prompt_token_ids or []
            ) < (request.sampling_params.max_tokens if request.sampling_params else 0):
                token = 3 + len(tokens) * 7 % 500
                tokens.append(token)
                sampled[request_id] = token
        return sampled

    def _check_load(self, job: TransferJob) -> None:
        tokens = self.tokens[job.request_id]
        blocks = self.scheduler.kv_cache_manager.get_block_ids(job.request_id)[0]
        for block in job.block_ids:
            index = blocks.index(block)
            for offset in range(self.block_size):
                position = index * self.block_size + offset
                for layer in range(len(LAYERS)):
                    want = _kv_value(tokens, position, layer)
                    got = self.kv[layer, block, :, offset, :]
                    assert bool((got == want).all()), (
                        f"load job {job.job_id}: block {block} position {position} layer {layer}"
                    )
        self.loads_checked += 1

    def jobs_of(self, kind: JobKind) -> list[TransferJob]:
        return [
            j for r in self.steps for j in (r.plan.loads if kind is JobKind.LOAD else r.plan.stores)
        ]
