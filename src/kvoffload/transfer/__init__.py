"""The worker half: the engine's KV layout, copies to and from host memory, results.

The only home of torch and CUDA streams (with :mod:`kvoffload.tiers.host`). Build a
worker from an engine's ``dict[layer name, tensor]`` with
:meth:`TransferWorker.for_kv_caches`, feed it the jobs of each :class:`StepPlan`, and
send ``report()`` back to the scheduler half.
"""

from kvoffload.transfer.layout import KVLayout, PageGroup, register_kv_caches
from kvoffload.transfer.worker import CopyHook, TransferWorker

__all__ = ["CopyHook", "KVLayout", "PageGroup", "TransferWorker", "register_kv_caches"]
