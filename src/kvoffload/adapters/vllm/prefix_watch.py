"""Noticing that vLLM's prefix cache was reset, from the scheduler half.

vLLM resets its prefix cache (``reset_prefix_cache()``; RL frameworks call it after
they update the weights in place) without telling a connector unless
``reset_connector=True``. kvoffload must then check whether the weights changed
(decision 0019). A successful reset replaces the block pool's map from block hash to
cached block with a new, empty one (``BlockPool.reset_prefix_cache``, vLLM 0.32 and
0.33), so the scheduler half, which vLLM binds to the pool
(``bind_gpu_block_pool``), sees a reset as that object changing. A failed reset
(blocks still in use) changes nothing, and nothing is noticed, as vLLM's own cache
keeps serving then too.

Owned by the scheduler half; read on its thread.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("kvoffload")

_MAP = "cached_block_hash_to_block"


class PrefixCacheWatch:
    """Watches one vLLM block pool for prefix-cache resets (module docstring)."""

    def __init__(self, pool: object) -> None:
        self._pool = pool
        self._seen = getattr(pool, _MAP, None)
        if self._seen is None:
            logger.warning(
                "kvoffload: this vLLM's block pool has no %s; a reset of the prefix cache "
                "is not noticed: after updating weights in place call "
                "reset_prefix_cache(reset_connector=True)",
                _MAP,
            )

    def reset_seen(self) -> bool:
        """Whether the prefix cache was reset since the last call."""
        current = getattr(self._pool, _MAP, None)
        if current is self._seen:
            return False
        self._seen = current
        return True
