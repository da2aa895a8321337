"""``KVOffloadConnector``: kvoffload as a vLLM KV connector.

Enable with::

    --kv-transfer-config '{"kv_connector": "KVOffloadConnector",
                           "kv_connector_module_path": "kvoffload.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"cpu_bytes": 4000000000}}'

One class, two roles: in the scheduler process it wraps kvoffload's scheduler half
(:class:`SchedulerSide`), in each worker the worker half (:class:`WorkerSide`).
kvoffload is ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on, with one
block table per KV cache group (full attention and sliding windows; see
``geometry.py``). It is a best-effort cache: ``request_finished`` never holds blocks, a
preempted request is recomputed rather than waited for, and a failed load is
recomputed (the connector sets ``kv_load_failure_policy`` to ``recompute`` where
vLLM's scheduler reads it, also inside ``MultiConnector``: ``load_failure.py``).
Deployments it cannot serve (pipeline or context parallelism, a ``kv_role`` other
than ``kv_both``) are refused at start in one line (``deployment.py``).
Invalid ``kv_connector_extra_config`` fails the engine at start-up with a
:class:`~kvoffload.core.errors.ConfigError` naming the key (with the vLLM plugin
installed, before the model loads: ``plugin.py``). Each role logs one start-up
summary through vLLM's logging (``startup.py``).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kvoffload.adapters.vllm.compat import (
    AttentionMetadata,
    CacheHitSource,
    ForwardContext,
    KVCacheBlocks,
    KVCacheConfig,
    KVCacheEvent,
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorPromMetrics,
    KVConnectorRole,
    KVConnectorStats,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    Request,
    SchedulerOutput,
    SupportsHMA,
    VllmConfig,
    is_transfer_agent,
)
from kvoffload.adapters.vllm.deployment import check_deployment
from kvoffload.adapters.vllm.load_failure import enforce_recompute
from kvoffload.adapters.vllm.logs import attach_to_vllm_logging
from kvoffload.adapters.vllm.messages import PlanMetadata
from kvoffload.adapters.vllm.scheduler_side import SchedulerSide
from kvoffload.adapters.vllm.startup import warn_tiers
from kvoffload.adapters.vllm.stats import KVOffloadPromMetrics, KVOffloadStats
from kvoffload.adapters.vllm.versions import check_vllm_version
from kvoffload.adapters.vllm.worker_side import WorkerSide
from kvoffload.core.config.typed import OffloadConfig
from kvoffload.core.errors import ConfigError

logger = logging.getLogger("kvoffload")


class KVOffloadConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        attach_to_vllm_logging()  # also when the plugin entry point is not loaded
        transfer = vllm_config.kv_transfer_config
        if transfer is None:  # the base class already refuses this
            raise ConfigError("kv_transfer_config", "must be set")
        config = OffloadConfig.from_dict(transfer.kv_connector_extra_config or {})
        self.config = config
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        check_vllm_version()
        check_deployment(vllm_config, transfer)
        if role == KVConnectorRole.SCHEDULER:
            # A failed load is a cache miss: vLLM recomputes the request's blocks,
            # also when kvoffload is one child of a MultiConnector (load_failure.py).
            policy = enforce_recompute(transfer, self).describe()
            warn_tiers(config)
            self.scheduler_side = SchedulerSide(vllm_config, kv_cache_config, config)
            logger.info("%s", self.scheduler_side.summary(policy))
        else:
            self.worker_side = WorkerSide(vllm_config, kv_cache_config, config)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a dropped store is a future miss, never lost data

    # ------------------------------------------------------------ scheduler role

    def _sched(self) -> SchedulerSide:
        if self.scheduler_side is None:
            raise RuntimeError("kvoffload: scheduler call on a worker-role connector")
        return self.scheduler_side

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._sched().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._sched().update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        return self._sched().hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._sched().build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._sched().update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._sched().request_finished(request)
        return False, None

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's hybrid KV cache manager (HMA) calls this instead of
        ``request_finished``: the same for every KV cache group (blocks never held)."""
        self._sched().request_finished(request)
        return False, None

    def has_pending_push_work(self) -> bool:
        """Keeps vLLM's engine stepping until kvoffload's jobs have drained."""
        side = self.scheduler_side
        return side is not None and side.has_pending_work()

    def take_events(self) -> list[KVCacheEvent]:
        """Stored / removed events of every tier, in vLLM's KV event types."""
        return self._sched().take_events()

    # ------------------------------------------------------------ metrics

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """Scheduler role: kvoffload's metrics delta since the previous step (see
        ``adapters/vllm/stats.py``). Workers send nothing: their results already
        reach the scheduler half in the step reports."""
        if self.scheduler_side is None:
            return None
        return self.scheduler_side.connector_stats()

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return KVOffloadStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return KVOffloadPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def reset_cache(self) -> bool:
        return self._sched().reset_cache()

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        """vLLM's block pool, bound after the scheduler is built (also under
        ``MultiConnector``): a reset of its prefix cache makes the workers check their
        weights (``prefix_watch.py``, decision 0019)."""
        if self.scheduler_side is not None:
            self.scheduler_side.bind_block_pool(gpu_block_pool)

    # ------------------------------------------------------------ worker role

    def _work(self) -> WorkerSide:
        if self.worker_side is None:
            raise RuntimeError("kvoffload: worker call on a scheduler-role connector")
        return self.worker_side

    def _plan(self) -> PlanMetadata:
        meta = self._get_connector_metadata()
        if not isinstance(meta, PlanMetadata):
            raise RuntimeError(f"kvoffload: unexpected connector metadata {type(meta)}")
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._work().register_kv_caches(kv_caches)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any = None) -> bool:
        """vLLM 0.33+: kvoffload follows the KV cache's release and remap in sleep mode
        (:meth:`unregister_kv_caches`, :meth:`restore_kv_caches`)."""
        return True

    def unregister_kv_caches(self) -> None:
        """Before vLLM releases the KV cache memory (sleep): fence and drain every copy
        into or out of it (``sleep_state.py``; the scheduler role has none). Idempotent,
        never raises."""
        if self.worker_side is not None:
            try:
                self.worker_side.unregister_kv_caches()
            except Exception:
                logger.exception("kvoffload: unregister_kv_caches failed")

    def restore_kv_caches(self) -> None:
        """After wake-up: map the KV caches again, lift the fence. Idempotent, never
        raises."""
        if self.worker_side is not None:
            try:
                self.worker_side.restore_kv_caches()
            except Exception:
                logger.exception("kvoffload: restore_kv_caches failed")

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        if isinstance(kv_connector_metadata, PlanMetadata):
            self._work().handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._work().start_load_kv(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return None

    def wait_for_save(self) -> None:
        self._work().wait_for_save(self._plan())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._work().get_finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished loads, and the requests whose load failed when block ids cannot
        say what to recompute (several KV cache groups, a sliding window)."""
        work = self._work()
        _, finished = work.get_finished()
        return KVConnectorTransferResults(
            finished_recving=set(finished or ()), failed_recving=work.take_failed()
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._work().get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._work().build_connector_worker_meta()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        """This worker's weights fingerprint, for the scheduler half before the first
        step; None under ``MultiConnector`` (the handshake is the P/D connector's;
        the fingerprint comes with the first report, ``messages.py``)."""
        side = self.worker_side
        if side is None:
            return None
        top = side.top_level if side.top_level is not None else is_transfer_agent(self)
        return side.weights.handshake() if top else None

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.handshake(metadata.values())

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()
        if self.scheduler_side is not None:
            self.scheduler_side.shutdown()
