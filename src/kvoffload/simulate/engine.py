"""The reference engine in its fast mode: requests without token ids, a null model.

- :class:`SimRequest` is the engine's request whose block hashes come from its
  :class:`~kvoffload.simulate.content.Content` instead of token ids (the prompt is a
  placeholder of the right length).
- :class:`SimBatcher` is the engine's batch former with the same decisions; only the
  scans for waiting requests that hold blocks look at those requests instead of the
  whole queue (the reference scans the queue for every running request).
- :class:`SimEngine` replaces the deterministic model with a null model that
  computes no KV: a forward pass only counts the tokens it would compute (prefill,
  recompute, decode) into the step meter, and samples up to ``decode_stride``
  tokens at once; the next pass computes their KV (one decode step stands for
  ``decode_stride`` real ones). A request finishes once the KV of every token but
  its last is computed, as in a real engine.

Everything else (block pool and prefix cache, chunked prefill, preemption, the calls
into kvoffload's scheduler half) is the reference engine's code.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvoffload.core.scheduler import OffloadScheduler
from kvoffload.core.scheduler_types import ScheduledRequest
from kvoffload.engine.batcher import Batcher, _Admission
from kvoffload.engine.block_pool import BlockPool
from kvoffload.engine.engine import EngineWorker, ReferenceEngine, _Batch
from kvoffload.engine.request import Request, Status
from kvoffload.engine.settings import EngineConfig
from kvoffload.simulate.content import ContentHasher
from kvoffload.simulate.trace import TraceRequest


class SimRequest(Request):
    """A request of the simulation (see the module docstring); mutated by its engine
    (progress) and by the simulation driver (the timing fields)."""

    def __init__(
        self, request_id: str, spec: TraceRequest, index: int, hasher: ContentHasher
    ) -> None:
        prompt_tokens = spec.prompt_tokens
        super().__init__(request_id, (), spec.output, hasher.block_size, spec.salt)
        self.prompt = [0] * prompt_tokens  # placeholder ids: only the length is read
        self.content = hasher.content(spec, index)
        self.hasher = hasher
        self._hashes = hasher.initial(self.content)[: prompt_tokens // hasher.block_size]
        self.arrival = spec.t
        self.first_token_at: float | None = None
        self.computed_high = 0  # positions whose KV was ever computed (decode accounting)
        self.admissions = 0
        self.first_local = 0  # tokens from the engine's prefix cache at the first admission
        self.first_external = 0  # tokens loaded from kvoffload at the first admission
        self.cached_list: list[int] | None = None  # block list cached_upto refers to
        self.cached_upto = 0  # leading blocks registered in the prefix cache

    @property
    def block_hashes(self) -> list[bytes]:
        full = self.num_tokens // self.block_size
        if len(self._hashes) < full:
            self.hasher.extend(self.content, self._hashes, full)
        return self._hashes


@dataclass
class StepMeter:
    """What the current engine step computes; reset by the driver every step."""

    prefill: int = 0  # positions computed that are not fresh output (incl. recompute)
    decode: int = 0  # output positions whose KV is computed for the first time
    first_tokens: list[SimRequest] = field(default_factory=list)
    finished: list[SimRequest] = field(default_factory=list)
    scheduled: int = 0  # requests scheduled this step

    def reset(self) -> None:
        self.prefill = self.decode = self.scheduled = 0
        self.first_tokens.clear()
        self.finished.clear()


class SimBatcher(Batcher):
    """The reference batch former, with the holder scans restricted to candidates.

    Waiting requests hold blocks only after an admission that issued a load, so
    those are remembered (``_holding``) and filtered, in queue order, instead of
    scanning the whole queue; the results are the same lists."""

    def __init__(
        self,
        config: EngineConfig,
        pool: BlockPool,
        scheduler: OffloadScheduler | None,
        meter: StepMeter,
    ) -> None:
        super().__init__(config, pool, scheduler)
        self._holding: list[Request] = []
        self.meter = meter
        self.readmissions = 0
        self.readmission_external = 0  # tokens loaded when re-admitted after preemption

    def schedule(self) -> tuple[list[tuple[ScheduledRequest, Request]], tuple[str, ...]]:
        out, preempted = super().schedule()
        self.meter.scheduled = len(out)
        return out, preempted

    def _admit(self, req: Request, budget: int) -> _Admission:
        admission = super()._admit(req, budget)
        if not req.block_ids:
            return admission  # deferred, or no blocks: not admitted
        external = req.load[1] if req.load is not None else 0
        if req.status is Status.WAITING_FOR_LOAD and req not in self._holding:
            self._holding.append(req)
        if isinstance(req, SimRequest):
            if req.admissions == 0:
                req.first_local, req.first_external = req.num_computed_tokens, external
            else:
                self.readmissions += 1
                self.readmission_external += external
            req.admissions += 1
        return admission

    def cache_computed(self, req: Request) -> None:
        """The reference's registration, skipping the leading blocks already
        registered under their own hash (for those it is a no-op: a block held by a
        request keeps its hash). The skip is forgotten when the request's block list
        is replaced (admission, preemption)."""
        if not isinstance(req, SimRequest):
            super().cache_computed(req)
            return
        if req.status is Status.WAITING_FOR_LOAD or req.done or not self.pool.caching:
            return
        if req.cached_list is not req.block_ids:
            req.cached_list, req.cached_upto = req.block_ids, 0
        full = min(req.num_computed_tokens // self.config.block_size, len(req.block_hashes))
        start = req.cached_upto
        if start >= full:
            return
        blocks, hashes = req.block_ids, req.block_hashes
        pool = self.pool
        pool.cache(blocks[start:full], hashes[start:full])
        hash_of = pool.hash_of
        while start < full and hash_of[blocks[start]] == hashes[start]:
            start += 1
        req.cached_upto = start

    def _live_holders(self) -> list[Request]:
        waiting = (Status.WAITING, Status.WAITING_FOR_LOAD)
        self._holding = [r for r in self._holding if r.block_ids and r.status in waiting]
        return self._holding

    def _idle_holders(self) -> list[Request]:
        if not self._holding:
            return []
        idle = [
            r
            for r in self._live_holders()
            if r.status is not Status.WAITING_FOR_LOAD or r.load_ok is not None
        ]
        if len(idle) > 1:
            idle.sort(key=self.waiting.index)
        return idle

    def _loads_in_flight(self) -> bool:
        return any(
            r.status is Status.WAITING_FOR_LOAD and r.load_ok is None for r in self._live_holders()
        )


class SimEngine(ReferenceEngine):
    """The reference engine with a null model (see the module docstring)."""

    def __init__(
        self,
        config: EngineConfig,
        scheduler: OffloadScheduler | None,
        worker: EngineWorker | None,
        pool: BlockPool,
        *,
        meter: StepMeter,
        decode_stride: int,
    ) -> None:
        super().__init__(config, scheduler, worker, pool)
        self.sim_batcher = SimBatcher(config, self.pool, scheduler, meter)
        self.batcher = self.sim_batcher
        self.meter = meter
        self.decode_stride = decode_stride

    def add(self, req: SimRequest) -> None:
        """Queue ``req`` (a request made by the driver) like ``add_request`` does."""
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def _forward(self, req: Request, sched: ScheduledRequest, batch: _Batch) -> None:
        """Count the pass's tokens; sample up to ``decode_stride`` tokens when every
        known token has KV; mark the request finishable when its last needed KV is
        computed (one ``batch.sampled`` entry per request, with a count: see _apply)."""
        start = sched.num_computed_tokens
        end = start + sched.num_scheduled_tokens
        meter = self.meter
        # Output positions whose KV is computed for the first time are decode work;
        # everything else (the prompt, recompute after preemption) is prefill.
        fresh = len(req.prompt)
        if isinstance(req, SimRequest):
            fresh = max(fresh, req.computed_high)
            req.computed_high = max(req.computed_high, end)
        decode = max(0, end - max(fresh, start))
        meter.decode += decode
        meter.prefill += end - start - decode
        known = len(req.prompt) + len(req.output) + len(req.pending)
        if end == known and req.wants_more():
            sampled = min(self.decode_stride, req.max_tokens - known + len(req.prompt))
            req.pending += [0] * sampled
            batch.sampled.append((req, req.generation, sampled))
            if isinstance(req, SimRequest) and req.first_token_at is None:
                meter.first_tokens.append(req)
        elif end == known - 1 and not req.wants_more():
            batch.sampled.append((req, req.generation, 0))  # all its KV is computed

    def _apply(self, batch: _Batch) -> None:
        """Apply sampled tokens in bulk, then the reports. A request that has all its
        tokens finishes once the KV of every token but the last is computed (as in a
        real engine, where each decode step computes the previous token's KV), which
        takes one more pass after a multi-token sample."""
        sampled, batch.sampled = batch.sampled, []
        for req, generation, count in sampled:
            if generation != req.generation or req.status is not Status.RUNNING:
                continue
            if count:
                del req.pending[:count]
                req.output += [0] * count
            if len(req.output) >= req.max_tokens and req.num_computed_tokens >= req.num_tokens - 1:
                self._finish(req)
        super()._apply(batch)

    def _finish(self, req: Request) -> None:
        super()._finish(req)
        del self.requests[req.request_id]
        if isinstance(req, SimRequest):
            req.hasher.remember(req.content, req.block_hashes)
            self.meter.finished.append(req)
