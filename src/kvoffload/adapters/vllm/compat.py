"""Every vLLM import kvoffload depends on, in one place.

kvoffload targets the KV connector API of vLLM 0.32 (``KVConnectorBase_V1`` with the
three-argument constructor, ``get_transfer_results``, worker metadata aggregation,
``kv_load_failure_policy``). When that API moves, this module is what changes.
"""

from __future__ import annotations

from vllm.config import VllmConfig
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent, KVEventBatch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)
from vllm.forward_context import ForwardContext
from vllm.multimodal.utils import get_mm_features_in_window
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.attention.backend import AttentionMetadata
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import (
    generate_block_hash_extra_keys,
    hash_block_tokens,
    maybe_convert_block_hash,
    to_event_extra_keys,
)
from vllm.v1.core.sched.interface import PauseState, SchedulerInterface
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request

__all__ = [
    "AttentionMetadata",
    "AttentionSpec",
    "BlockRemoved",
    "BlockStored",
    "CacheHitSource",
    "ForwardContext",
    "FullAttentionSpec",
    "KVCacheBlocks",
    "KVCacheConfig",
    "KVCacheEvent",
    "KVCacheSpec",
    "KVConnectorBase_V1",
    "KVConnectorHandshakeMetadata",
    "KVConnectorMetadata",
    "KVConnectorOutput",
    "KVConnectorPromMetrics",
    "KVConnectorRole",
    "KVConnectorStats",
    "KVConnectorTransferResults",
    "KVConnectorWorkerMetadata",
    "KVEventBatch",
    "MLAAttentionSpec",
    "PauseState",
    "Request",
    "SchedulerInterface",
    "SchedulerOutput",
    "SlidingWindowSpec",
    "SupportsHMA",
    "VllmConfig",
    "generate_block_hash_extra_keys",
    "get_hash_fn_by_name",
    "get_mm_features_in_window",
    "hash_block_tokens",
    "kv_cache_utils",
    "maybe_convert_block_hash",
    "to_event_extra_keys",
]


def tensor_parallel_rank() -> int:
    """This worker's rank among the workers that share one scheduler (TP x PP)."""
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group

    tp, pp = get_tp_group(), get_pp_group()
    return pp.rank_in_group * tp.world_size + tp.rank_in_group


def is_transfer_agent(connector: object) -> bool:
    """Whether ``connector`` is this worker process's KV connector itself (vLLM's
    agent), not one child of a ``MultiConnector``."""
    from vllm.distributed.kv_transfer import kv_transfer_state

    return kv_transfer_state.has_kv_transfer_group() and (
        kv_transfer_state.get_kv_transfer_group() is connector
    )
