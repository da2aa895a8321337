"""The connector's scheduler role: vLLM's scheduler calls mapped onto kvoffload's
scheduler half (one per engine; no tensors)."""

from __future__ import annotations

import logging
from pathlib import Path

from kvoffload.adapters.vllm.compat import (
    KVCacheBlocks,
    KVCacheConfig,
    KVConnectorOutput,
    Request,
    SchedulerOutput,
    VllmConfig,
)
from kvoffload.adapters.vllm.geometry import Geometry, derive_geometry
from kvoffload.adapters.vllm.messages import PlanMetadata, ReportMetadata
from kvoffload.core.config import OffloadConfig
from kvoffload.core.directory import Directory
from kvoffload.core.errors import ConfigError
from kvoffload.core.scheduler import OffloadScheduler
from kvoffload.core.scheduler_types import ScheduledRequest, StepInput
from kvoffload.core.tiering import LowerTier
from kvoffload.tiers.disk_index import open_disk_tier
from kvoffload.tiers.redis_client import RedisSettings, make_client
from kvoffload.tiers.redis_index import RedisIndex

logger = logging.getLogger("kvoffload")


def step_input(output: SchedulerOutput) -> StepInput:
    """kvoffload's view of one vLLM scheduling step (single KV cache group)."""
    counts = output.num_scheduled_tokens
    scheduled = [
        ScheduledRequest(
            new.req_id,
            new.num_computed_tokens,
            counts.get(new.req_id, 0),
            tuple(new.block_ids[0]) if new.block_ids else (),
            replace=True,
        )
        for new in output.scheduled_new_reqs
    ]
    cached = output.scheduled_cached_reqs
    for i, request_id in enumerate(cached.req_ids):
        blocks = cached.new_block_ids[i]
        scheduled.append(
            ScheduledRequest(
                request_id,
                cached.num_computed_tokens[i],
                counts.get(request_id, 0),
                tuple(blocks[0]) if blocks else (),
                replace=request_id in cached.resumed_req_ids,
            )
        )
    return StepInput(tuple(scheduled), tuple(sorted(output.preempted_req_ids or ())))


class SchedulerSide:
    """Owns the scheduler half and its host-tier directory for one engine."""

    def __init__(
        self, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, config: OffloadConfig
    ) -> None:
        self.geometry: Geometry = derive_geometry(vllm_config, kv_cache_config, config)
        directory = Directory(
            self.geometry.num_slots,
            tier="host",
            policy=config.eviction,
            store_threshold=config.store_threshold,
        )
        g = self.geometry
        lower: list[LowerTier] = []
        self.redis_index: RedisIndex | None = None
        if config.disk_path is not None:
            disk, removed = open_disk_tier(
                Path(config.disk_path),
                g.namespace.digest(),
                g.world_size,
                g.disk_slots,
                config.eviction,
            )
            if removed:
                logger.info("kvoffload: removed %d incomplete or surplus chunk files", removed)
            lower.append(disk)
        if config.redis_url is not None:
            self.redis_index = RedisIndex(
                make_client(redis_settings(config)), g.namespace.digest(), g.world_size
            )
            lower.append(self.redis_index)
        self.scheduler = OffloadScheduler(
            g.scheduler_config(config),
            directory,
            g.namespace,
            lower_tiers=lower,
            spill_after_hits=config.spill_after_hits,
        )

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tokens = self.scheduler.lookup(request, num_computed_tokens)
        if tokens is None:
            return None, False
        return tokens, tokens > 0

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        block_ids = blocks.get_block_ids()[0] if num_external_tokens else []
        self.scheduler.on_allocated(request.request_id, block_ids, num_external_tokens)

    def build_connector_meta(self, output: SchedulerOutput) -> PlanMetadata:
        return PlanMetadata(self.scheduler.build_plan(step_input(output)))

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        meta = output.kv_connector_worker_meta
        if isinstance(meta, ReportMetadata):
            for report in meta.reports:
                self.scheduler.on_report(report)

    def request_finished(self, request: Request) -> None:
        self.scheduler.on_finished(request.request_id)

    def reset_cache(self) -> bool:
        self.scheduler.reset()
        return True

    def shutdown(self) -> None:
        if self.redis_index is not None:
            self.redis_index.close()


def redis_settings(config: OffloadConfig) -> RedisSettings:
    if config.redis_url is None:
        raise ConfigError("redis_url", "is not set")
    return RedisSettings(
        url=config.redis_url,
        cluster=config.redis_cluster,
        timeout_ms=config.redis_timeout_ms,
        username=config.redis_username,
        password=config.redis_password,
    )
