"""The reference engine in its fast mode: requests without token ids, a null model.

- Its requests are :class:`~kvoffload.simulate.request.SimRequest` (block hashes
  from their content, no token ids).
- :class:`NullModel` is the engine's model strategy: it computes no KV, a forward
  pass only counts the tokens it would compute (prefill, recompute, decode) into the
  step meter, and samples up to ``decode_stride`` tokens at once; the next pass
  computes their KV (one decode step stands for ``decode_stride`` real ones). A
  request finishes once the KV of every token but its last is computed, as in a
  real engine.
- :func:`sim_engine` builds the reference engine with it and the batcher's fast
  strategies (:mod:`kvoffload.simulate.batching`: the same decisions, fewer scans);
  for a hybrid model, with per-group block tables
  (:class:`~kvoffload.engine.group_tables.GroupTables`, also its registration).

Everything else (block pool and prefix cache, chunked prefill, preemption, the calls
into kvoffload's scheduler half) is the reference engine's code.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvoffload.core.scheduler import OffloadScheduler
from kvoffload.core.scheduler_types import ScheduledRequest
from kvoffload.core.step_runner import StepRunner
from kvoffload.engine.batcher import Batcher
from kvoffload.engine.block_pool import BlockPool
from kvoffload.engine.engine import ReferenceEngine
from kvoffload.engine.group_tables import GroupTables
from kvoffload.engine.request import Request, Status
from kvoffload.engine.settings import EngineConfig
from kvoffload.engine.strategies import Sampled
from kvoffload.simulate.batching import Admissions, RegisterNew, TrackedHolders
from kvoffload.simulate.request import SimRequest, StepMeter
from kvoffload.simulate.worker import SimWorker


class NullModel:
    """The simulator's :class:`~kvoffload.engine.strategies.Model` (see the module
    docstring): what it samples is a count of tokens; writes into ``meter``."""

    def __init__(self, meter: StepMeter, decode_stride: int) -> None:
        self.meter = meter
        self.decode_stride = decode_stride

    def forward(self, req: Request, sched: ScheduledRequest, sampled: list[Sampled]) -> None:
        """Count the pass's tokens; sample up to ``decode_stride`` tokens when every
        known token has KV; mark the request finishable when its last needed KV is
        computed (one ``sampled`` entry per request, with a count: see :meth:`apply`)."""
        start = sched.num_computed_tokens
        end = start + sched.num_scheduled_tokens
        meter = self.meter
        meter.scheduled += 1
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
            count = min(self.decode_stride, req.max_tokens - known + len(req.prompt))
            req.pending += [0] * count
            sampled.append((req, req.generation, count))
            if isinstance(req, SimRequest) and req.first_token_at is None:
                meter.first_tokens.append(req)
        elif end == known - 1 and not req.wants_more():
            sampled.append((req, req.generation, 0))  # all its KV is computed

    def apply(self, sampled: Sequence[Sampled], finish: Callable[[Request], None]) -> None:
        """Apply sampled tokens in bulk. A request that has all its tokens finishes
        once the KV of every token but the last is computed (as in a real engine,
        where each decode step computes the previous token's KV), which takes one
        more pass after a multi-token sample."""
        for req, generation, count in sampled:
            if generation != req.generation or req.status is not Status.RUNNING:
                continue
            if count:
                del req.pending[:count]
                req.output += [0] * count
            if len(req.output) >= req.max_tokens and req.num_computed_tokens >= req.num_tokens - 1:
                finish(req)


def _finished(meter: StepMeter, req: Request) -> None:
    """A request finished: remember its content's hashes, meter it."""
    if isinstance(req, SimRequest):
        req.hasher.remember(req.content, req.block_hashes)
        meter.finished.append(req)


def sim_engine(
    config: EngineConfig,
    scheduler: OffloadScheduler | None,
    worker: SimWorker | None,
    pool: BlockPool,
    *,
    meter: StepMeter,
    decode_stride: int,
    admissions: Admissions,
    tables: GroupTables | None = None,
) -> ReferenceEngine:
    """The reference engine with the null model and the fast batcher strategies,
    running its plans on ``worker`` (through a step runner; with ``scheduler`` or
    neither); finished requests leave its ``requests``; ``admissions`` counts
    re-admissions. ``tables``: several KV cache groups' tables over ``pool`` (None:
    one full-attention group)."""
    batcher = Batcher(
        config,
        pool,
        scheduler,
        holders=TrackedHolders(),
        registration=tables or RegisterNew(pool, config.block_size),
        tables=tables,
        on_admitted=admissions.record,
    )
    return ReferenceEngine(
        config,
        scheduler,
        StepRunner(worker) if worker is not None else None,
        pool,
        model=NullModel(meter, decode_stride),
        batcher=batcher,
        on_finished=lambda req: _finished(meter, req),
        keep_finished=False,
    )
