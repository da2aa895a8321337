"""The scheduler half: per-request state machines, transfer jobs, the per-step plan.

One instance per engine. The engine (the vLLM adapter or the reference engine)
calls, in each scheduling pass:

1. ``lookup(request, num_computed_tokens)`` for waiting requests: tokens loadable past
   the engine's own prefix hit, or :data:`RETRY_LATER`;
2. ``on_allocated(request, blocks, num_external_tokens)`` once blocks are
   allocated (one block list per KV cache group; emits one load job when
   ``num_external_tokens > 0``); the engine has the last word: every request it
   allocates for is tracked, whatever lookup said;
3. ``on_finished(request_id)`` / ``on_aborted`` when a request ends (its blocks are
   freed at once; final stores are planned from them and fenced);
4. ``build_plan(StepInput)`` at the end of the pass: the :class:`StepPlan` for every
   worker;

and ``on_report(WorkerReport)`` for each worker's output when it arrives, which may
be one step late (asynchronous scheduling).

Correct by construction under every interleaving of those calls:

- A request with any job in flight is never looked up in the directory: lookup
  answers retry later, bounded by ``max_deferral_steps`` busy steps (idle ones do not
  count) or ``max_deferral_seconds``; past the bound it answers 0 and the request
  recomputes: no load is ever issued on top of its stores (decision 0002).
- Every in-flight store fences its source blocks: a store whose block is handed out
  fresh in a step (to any request, or as a load destination) is in that step's
  ``flush`` set, so the worker finishes it before the block is written.
- Jobs complete exactly once (all workers reported). A failed load unpins its chunks
  (the engine recomputes its blocks); a failed store frees its slots. Nothing in a
  failure path raises; surprising input is an anomaly (decision 0006).

Owned state: the request states, the job tracker and the directory; callers receive
immutable plans and completions.
"""

from kvoffload.core.scheduler.facade import OffloadScheduler

__all__ = ["OffloadScheduler"]
