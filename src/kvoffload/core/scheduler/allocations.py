"""Allocations: the engine handed a request its blocks; every allocation is an
admission (decision 0006).

The engine has the last word: whatever lookup answered, the request is tracked from
here with its full block list. After a lookup this is an admission: a hit the engine
accepted emits one load job (into the step builder), anything else admits the
request to run. Without one (vLLM resuming a request whose load landed) only the
block list is refreshed. Every block past the engine's own prefix hit is fresh
from here, whoever fills it (another connector's load under ``MultiConnector``
included): the next plan flushes the stores still reading one. Never raises on
surprising input: an allocation of another hit than offered, or a load into the
null block or a block named twice, is an anomaly whose blocks are reported invalid,
so the engine recomputes them.
"""

from __future__ import annotations

from kvoffload.core.observe.anomalies import Anomaly
from kvoffload.core.scheduler.block_tables import GroupBlocks
from kvoffload.core.scheduler.context import Context
from kvoffload.core.scheduler.loads import LoadPlanner
from kvoffload.core.scheduler.request_state import Phase, RequestState
from kvoffload.core.scheduler.step_builder import StepBuilder
from kvoffload.core.scheduler_types import EngineRequest


class Allocations:
    def __init__(self, ctx: Context, loads: LoadPlanner, builder: StepBuilder) -> None:
        self.config = ctx.config
        self.directory = ctx.directory
        self.requests = ctx.requests
        self.deferral = ctx.deferral
        self.anomalies = ctx.anomalies
        self.weights = ctx.weights
        self.loads = loads
        self.builder = builder

    def on_allocated(
        self, request: EngineRequest, blocks: GroupBlocks, num_external_tokens: int
    ) -> None:
        """See the module docstring."""
        state = self.requests.get(request.request_id)
        if state is None:
            state = self.requests.new(request)
        elif state.finished:
            return  # a reused request id (counted at lookup): not offloaded
        state.request = request
        hit, state.lookup_hit = state.lookup_hit, None
        local, offered = hit if hit is not None else (0, 0)
        if num_external_tokens and not offered:
            self.anomalies.note(
                Anomaly.EXTERNAL_TOKENS,
                f"request {request.request_id!r}: {num_external_tokens} external tokens "
                "allocated, none offered; nothing loaded",
            )
        if hit is None and state.phase in (Phase.RUNNING, Phase.LOADING):
            state.blocks.replace(blocks)  # resumed after its load: same admission
            return
        # Past the engine's own hit, whoever fills the blocks (without a lookup the
        # hit is unknown: every block, which at worst flushes a store early).
        self.builder.add_allocation(blocks, local)
        self._admit(state, local + num_external_tokens, blocks)
        if not (num_external_tokens and offered):
            state.move(Phase.RUNNING)
            return
        job = self.loads.plan(state, local, num_external_tokens, offered=offered, blocks=blocks)
        self.builder.add_load(job)
        state.move(Phase.LOADING)

    def _admit(self, state: RequestState, hit_tokens: int, blocks: GroupBlocks) -> None:
        """Admission bookkeeping: recency of the hit, reuse counts, the end of any
        deferral, a fresh store cursor (never stored while the weights are not known:
        its keys may not name the weights it is computed with) and the full block list."""
        keys = state.keys.extend(state.request.block_hashes)
        groups = self.config.kv_groups
        self.directory.touch(groups.all_keys(keys[: hit_tokens // self.config.chunk_tokens]))
        self.directory.record_lookups(groups.all_keys(keys))
        self.deferral.end(state)
        state.admit(blocks, weights_known=self.weights.known)
