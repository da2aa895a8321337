"""A step's worker outputs handed to the scheduler one step late, merged with the
next step's, as vLLM 0.33's fault tolerance does (``enable_fault_tolerance``: a step
in which a worker failed raises, and the connector outputs of the workers that
answered are stashed by ``KVOutputAggregator.ft_defer_kv_connector_outputs`` and
merged into the next step's aggregate, before that step's own).

:class:`DeferredOutputs` stands in for the harness's aggregator: it merges every
rank's output of a step into one (vLLM's ``KVOutputAggregator``, also for one rank)
with whatever an earlier step stashed, in vLLM's order (stashed first); and, when a
test asks, it stashes a step's connector outputs instead of delivering them (the
step's sampled tokens still go to the scheduler: the harness models the reports'
delay, not the lost step). Ownership: the harness holds one; a stash is delivered
exactly once, with the next step.
"""

from __future__ import annotations

import dataclasses

from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.outputs import ModelRunnerOutput


class DeferredOutputs:
    def __init__(self, world_size: int) -> None:
        self.aggregator = KVOutputAggregator(world_size)
        self.stash: list[ModelRunnerOutput] = []
        self.defer_next = 0  # steps whose connector outputs are stashed
        self.deferred = 0  # steps deferred so far

    def merge(self, outputs: list[ModelRunnerOutput]) -> ModelRunnerOutput:
        """One step's runner output: its ranks' connector outputs merged (with the
        stash of an earlier step first), or, for a deferred step, none of them."""
        if self.defer_next:
            self.defer_next -= 1
            self.deferred += 1
            self.stash.extend(o for o in outputs if o.kv_connector_output is not None)
            return dataclasses.replace(outputs[0], kv_connector_output=None)
        stashed, self.stash = self.stash, []
        if not stashed and len(outputs) == 1:
            return outputs[0]  # one rank, nothing stashed: vLLM's engine passes it on
        merged = self.aggregator.aggregate([*stashed, *outputs], len(stashed))
        assert merged is not None
        return merged
