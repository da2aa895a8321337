"""The connector's worker role: runs each step's plan on kvoffload's worker half.

Per step, in vLLM's call order: ``handle_preemptions`` (before the forward pass)
submits the plan's flushed stores and waits for every flushed job;
``start_load_kv`` submits the loads (their blocks belong to requests that do not
run this step); ``wait_for_save`` (after the forward pass) submits the remaining
stores, which capture what this step computed; ``get_finished`` polls the results:
finished loads are reported by request id, failed loads' blocks (and the invalid
blocks a load names) are reported as invalid (so vLLM recomputes them), and every
result goes back to the scheduler half in the worker metadata. With anything but
one full-attention KV cache group a failed load's request is reported in
``failed_recving`` instead (:meth:`WorkerSide.take_failed`; vLLM then recomputes the
whole request): with several groups block ids name no group and vLLM refuses
invalid blocks; with a sliding window vLLM would recompute from the first invalid
block with the window before it missing (its null blocks). Nothing here raises for
a failed copy.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import torch

from kvoffload.adapters.vllm.compat import KVCacheConfig, VllmConfig, tensor_parallel_rank
from kvoffload.adapters.vllm.geometry import Geometry, derive_geometry
from kvoffload.adapters.vllm.messages import PlanMetadata, ReportMetadata
from kvoffload.adapters.vllm.scheduler_side import redis_settings
from kvoffload.adapters.vllm.startup import worker_summary
from kvoffload.core.config import OffloadConfig
from kvoffload.core.errors import ConfigError
from kvoffload.core.jobs import JobKind, JobResult, StepPlan, TransferJob, WorkerReport
from kvoffload.tiers.disk import DiskStore
from kvoffload.tiers.disk_store import DiskTierStore
from kvoffload.tiers.redis_client import make_client
from kvoffload.tiers.redis_store import RedisStore
from kvoffload.transfer import CopyHook, TransferWorker
from kvoffload.transfer.cpu_kernel import NATIVE
from kvoffload.transfer.tier_worker import TierLane, TierStore, TierWorker

logger = logging.getLogger("kvoffload")


class WorkerSide:
    """Owns one worker's transfer worker and host slab."""

    def __init__(
        self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: OffloadConfig
    ) -> None:
        self.geometry: Geometry = derive_geometry(vllm_config, kv_cache_config, config)
        self.config = config
        self.worker: TransferWorker | None = None
        self.tiers: TierLane | None = None  # opened with the KV caches
        self.copy_hook: CopyHook | None = None  # tests: hold or fail copies
        self.rank_override: int | None = None  # harnesses running several ranks in one process
        self.rank = 0
        self._plan: StepPlan | None = None
        self._submitted: set[int] = set()
        self._flushed_step = -1
        self._jobs: dict[int, TransferJob] = {}
        self._results: list[JobResult] = []
        self._instant: list[JobResult] = []  # loads of invalid blocks only: done at once
        self._invalid_blocks: set[int] = set()
        self._failed: set[str] = set()  # failed loads reported by request (see above)
        groups = self.geometry.kv_groups
        self._by_request = not groups.single or groups.windowed

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        if self.rank_override is not None:
            self.rank = self.rank_override
        else:
            try:
                self.rank = tensor_parallel_rank()
            except (AssertionError, RuntimeError):
                self.rank = 0  # no distributed environment: a single worker
        g = self.geometry
        worker = TransferWorker.for_kv_caches(
            kv_caches,
            g.num_blocks,
            blocks_per_chunk=g.blocks_per_chunk,
            host_budget_bytes=g.host_bytes_per_worker,
            threads=self.config.copy_threads,
            rank=self.rank,
            hook=self.copy_hook,
        )
        if worker.slab.num_slots != g.num_slots:
            worker.shutdown()
            raise ConfigError(
                "kv_caches",
                f"the registered KV tensors hold {worker.layout.chunk_bytes(g.blocks_per_chunk)} "
                f"bytes per chunk, the KV cache config {g.chunk_bytes}: unsupported layout",
            )
        self.worker = worker
        self.tiers = self._open_tiers(worker)
        logger.info("%s", self._summary(worker))

    def _summary(self, worker: TransferWorker) -> str:
        layout = worker.layout
        if layout.device.type == "cuda":
            copy_path = "CUDA copy engine"
        elif NATIVE:
            copy_path = f"compiled kernel, {self.config.copy_threads} thread(s)"
        else:
            copy_path = "numpy (slower)"
            logger.warning(
                "kvoffload: the compiled copy kernel is missing (built at install time "
                "with a C compiler); copies use numpy and are slower"
            )
        tiers = sorted(self.tiers.stores) if isinstance(self.tiers, TierWorker) else []
        disk = self.tiers.stores.get("disk") if isinstance(self.tiers, TierWorker) else None
        refused = isinstance(disk, DiskTierStore) and not disk.store.o_direct
        if self.config.disk_o_direct and refused:
            logger.warning(
                "kvoffload: disk_o_direct is set but the filesystem of %s refuses O_DIRECT; "
                "the disk tier uses buffered I/O",
                self.config.disk_path,
            )
        return worker_summary(
            rank=self.rank,
            world_size=self.geometry.world_size,
            layers=layout.num_layers,
            device=str(layout.device),
            slab_bytes=worker.slab.num_slots * worker.slab.chunk_bytes,
            slots=worker.slab.num_slots,
            copy_path=copy_path,
            tiers=tiers,
        )

    def _open_tiers(self, worker: TransferWorker) -> TierWorker | None:
        stores: dict[str, TierStore] = {}
        g, config = self.geometry, self.config
        digest = g.namespace.digest()
        if config.disk_path is not None:
            disk = DiskStore(
                Path(config.disk_path),
                digest,
                self.rank,
                g.chunk_bytes,
                g.disk_slots,
                o_direct=config.disk_o_direct,
            )
            stores["disk"] = DiskTierStore(disk)
        if config.redis_url is not None:
            client = make_client(redis_settings(config))
            stores["redis"] = RedisStore(client, digest, self.rank, g.chunk_bytes)
        return TierWorker(worker.slab, stores, threads=config.tier_threads) if stores else None

    # ------------------------------------------------------------ per step

    def handle_preemptions(self, metadata: PlanMetadata) -> None:
        self._begin(metadata.plan)

    def start_load_kv(self, metadata: PlanMetadata) -> None:
        plan = self._begin(metadata.plan)
        for job in plan.loads:
            self._submit(job)
        for job in (*plan.spills, *plan.promotions):
            if job.job_id not in self._submitted:
                self._submitted.add(job.job_id)
                if self.tiers is not None:
                    self.tiers.submit(job)
                else:  # no tier configured on this worker: report the job failed
                    self._results.append(JobResult(job.job_id, False, error="no such tier"))

    def wait_for_save(self, metadata: PlanMetadata) -> None:
        plan = self._begin(metadata.plan)
        for job in plan.stores:
            self._submit(job)

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        if self.worker is None:
            return None, None
        if self._plan is not None and self._plan.loads and self.copy_hook is None:
            # This step's loads take a millisecond or so: report them now rather than
            # a step later (a request waiting for its load gains a whole step).
            self.worker.wait(job.job_id for job in self._plan.loads)
        loaded: set[str] = set()
        if self.tiers is not None:
            self._results.extend(self.tiers.poll())
        instant, self._instant = self._instant, []
        for result in (*self.worker.poll(), *instant):
            job = self._jobs.pop(result.job_id, None)
            self._results.append(result)
            if job is None or job.kind is not JobKind.LOAD:
                continue
            loaded.add(job.request_id)
            failed = set(job.invalid_blocks) | (
                set() if result.success else set(job.moved_blocks())
            )
            if failed and self._by_request:
                self._failed.add(job.request_id)
            else:
                self._invalid_blocks.update(failed)
        return None, loaded or None

    def take_failed(self) -> set[str]:
        """Requests whose load failed since the last call, when failures are reported
        by request (see the module docstring; ``get_finished`` reports them too)."""
        failed, self._failed = self._failed, set()
        return failed

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self._invalid_blocks = self._invalid_blocks, set()
        return invalid

    def build_connector_worker_meta(self) -> ReportMetadata | None:
        if not self._results:
            return None
        results, self._results = tuple(self._results), []
        return ReportMetadata((WorkerReport(self.rank, results),))

    def shutdown(self) -> None:
        if self.tiers is not None:
            self.tiers.shutdown()
        if self.worker is not None:
            self.worker.shutdown(timeout=10.0)

    # ------------------------------------------------------------ internals

    def _begin(self, plan: StepPlan) -> StepPlan:
        """First call of a step: flush (submit this plan's flushed stores, then wait
        for every flushed job) before anything of this step runs."""
        if plan.step != self._flushed_step:
            self._flushed_step = plan.step
            self._plan = plan
            self._submitted = set()  # jobs are only ever submitted from their own plan
            for job in plan.stores:
                if job.job_id in plan.flush:
                    self._submit(job)
            if plan.flush and self.worker is not None:
                self.worker.wait(plan.flush)
        return plan

    def _submit(self, job: TransferJob) -> None:
        if job.job_id in self._submitted or self.worker is None:
            return
        self._submitted.add(job.job_id)
        self._jobs[job.job_id] = job
        if not job.slots:  # a load of invalid blocks only: nothing to copy
            self._instant.append(JobResult(job.job_id, True))
        elif job.kind is JobKind.STORE:
            self.worker.submit_store(job)
        else:
            self.worker.submit_load(job)
