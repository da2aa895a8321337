"""One worker's sleep mode (vLLM's ``unregister_kv_caches`` / ``restore_kv_caches``,
decision 0021), as an explicit state machine.

vLLM (0.33 and later) releases the KV cache memory of a sleeping engine: the worker
calls ``unregister_kv_caches`` before it frees (or unmaps) that memory and
``restore_kv_caches`` once it is back. Between the two, no copy of kvoffload may read
or write engine KV blocks. So:

- **unregister** (AWAKE -> DRAINING -> ASLEEP): every copier that touches engine
  blocks (the transfer worker: stores read them, loads write them; each tier's
  staging worker: tier loads write them) is *fenced* first: every copy submitted from
  then on fails at once with :data:`~kvoffload.core.jobs.ASLEEP`, and the tier loads
  still running (reading a disk or Redis) are refused their copy into the engine
  even after the wake-up: vLLM gave their blocks away. Then it *drains*: it waits for
  every copy submitted before the fence (local memory copies: they end). Jobs that
  touch no engine memory (spills and promotions between host memory and the lower
  tiers, tier reads into staging slots) go on. While ASLEEP every engine load and
  store of a plan fails at once with the same error (the worker half sets the
  backend's refusal from :attr:`WorkerSleep.refusal`): a load is recomputed, a
  store is never made readable; the scheduler half counts them
  (``kvoffload_sleep_refused_jobs_total``). The weights are not fingerprinted while
  asleep (a level-2 sleep released them too): the first plan after the wake-up is.
- **restore** (ASLEEP -> AWAKE): the copiers' views of the KV caches are derived
  again from the tensors registered at ``register_kv_caches`` (with CUDA's cumem
  allocator their addresses stay; re-derived anyway), then the fence is lifted. A
  layout that no longer matches (not seen with vLLM) keeps the worker ASLEEP: every
  engine job is refused from then on, logged once; the engine serves without
  offloading.

::

               unregister                 drained
    AWAKE ─────────────────▶ DRAINING ───────────▶ ASLEEP
      ▲ │                                          │ ▲ │
      └─┘ restore (no-op)      restore (views made │ └─┘ unregister (no-op),
      ▲                          again, fence off) │     restore that failed
      └────────────────────────────────────────────┘

Both calls are idempotent. Before ``register_kv_caches`` (no copiers) they only move
the state. Never raises: a failure is logged and leaves the fence up. Owned by one
worker half; called on its thread (vLLM's worker), like every per-step call.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable, Mapping

import torch

from kvoffload.core.errors import IllegalTransition
from kvoffload.core.jobs import ASLEEP
from kvoffload.transfer.worker import TransferWorker

logger = logging.getLogger("kvoffload")


class SleepPhase(enum.Enum):
    AWAKE = "awake"
    DRAINING = "draining"
    ASLEEP = "asleep"


_S = SleepPhase
TRANSITIONS: dict[tuple[SleepPhase, SleepPhase], str] = {
    (_S.AWAKE, _S.DRAINING): "unregister: the copiers fenced, waiting for their copies",
    (_S.DRAINING, _S.ASLEEP): "every copy submitted before the fence finished",
    (_S.ASLEEP, _S.AWAKE): "restore: the views made again, the fence lifted",
}


class WorkerSleep:
    """One worker's sleep state (module docstring). ``copiers`` gives the copiers that
    touch engine blocks, ``(worker, collect)`` pairs (``collect``: this thread collects
    its copies; False for a staging worker, whose lane thread does), and
    ``in_flight`` the tier loads running (refused their copy for good)."""

    def __init__(self) -> None:
        self.phase = SleepPhase.AWAKE
        self.sleeps = 0  # unregister calls that fenced (tests, logs)
        self._failed = False  # a restore failed: asleep for good

    @property
    def refusal(self) -> str | None:
        """Why every engine load and store fails at once now (None: awake)."""
        return None if self.phase is SleepPhase.AWAKE else ASLEEP

    def unregister(
        self, copiers: Iterable[tuple[TransferWorker, bool]], in_flight: Iterable[int]
    ) -> None:
        """Fence every copier, then wait for the copies submitted before (no-op unless
        AWAKE)."""
        if self.phase is not SleepPhase.AWAKE:
            return
        self._move(SleepPhase.DRAINING)
        self.sleeps += 1
        pairs = list(copiers)
        stale = set(in_flight)
        try:
            for worker, _ in pairs:
                worker.fence(ASLEEP, stale)
            for worker, collect in pairs:
                worker.drain(collect=collect)
        except Exception:  # never reaches vLLM; the fence stays up
            logger.exception("kvoffload: draining the copies for sleep failed")
        self._move(SleepPhase.ASLEEP)

    def restore(
        self,
        copiers: Iterable[tuple[TransferWorker, bool]],
        kv_caches: Mapping[str, torch.Tensor],
    ) -> None:
        """Derive every copier's views of ``kv_caches`` again and lift the fence (no-op
        unless ASLEEP; a restore that failed once is not tried again)."""
        if self.phase is not SleepPhase.ASLEEP or self._failed:
            return
        pairs = list(copiers)
        try:
            for worker, _ in pairs:
                worker.remap(kv_caches)
        except Exception:
            self._failed = True
            logger.exception(
                "kvoffload: the KV caches could not be mapped again after sleep; "
                "offloading is off for this worker (every load and store is refused)"
            )
            return
        for worker, _ in pairs:
            worker.lift()
        self._move(SleepPhase.AWAKE)

    def _move(self, new: SleepPhase) -> None:
        if (self.phase, new) not in TRANSITIONS:
            raise IllegalTransition(f"sleep: {self.phase.value} -> {new.value}")
        self.phase = new
