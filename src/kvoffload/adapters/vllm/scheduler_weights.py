"""The scheduler half's side of the weights' identity (decision 0019), as the
connector's scheduler role sees it.

- the workers' fingerprints, from vLLM's handshake (:meth:`SchedulerWeights.handshake`)
  and their reports (:meth:`SchedulerWeights.learn`), into the scheduler half
  (``OffloadScheduler.on_weights``); a change of weights is logged once;
- a reset of vLLM's prefix cache, noticed on the block pool vLLM binds
  (:mod:`.prefix_watch`), starts a weights check (:meth:`SchedulerWeights.watch`);
- LoRA adapters by the content vLLM loaded in their requests' keys: each id's pin,
  the workers' loads, the stamp of each plan's loads and stores (:mod:`.lora_identity`,
  decision 0025).

Owned by the scheduler role; called under its lock.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from kvoffload.adapters.vllm.lora_identity import LoraPins, LoraStamp
from kvoffload.adapters.vllm.messages import WeightsHandshake
from kvoffload.adapters.vllm.prefix_watch import PrefixCacheWatch
from kvoffload.core.jobs import StepPlan
from kvoffload.core.scheduler import OffloadScheduler

logger = logging.getLogger("kvoffload")


class SchedulerWeights:
    def __init__(self, scheduler: OffloadScheduler) -> None:
        self.scheduler = scheduler
        requests = scheduler.requests
        self.loras = LoraPins(requests.__iter__, requests.get, scheduler.anomalies)
        requests.key_extra = self.loras.extra
        self.prefix_watch: PrefixCacheWatch | None = None  # bound by vLLM's scheduler

    def bind_pool(self, pool: object) -> None:
        """vLLM's block pool: a reset of its prefix cache starts a weights check."""
        self.prefix_watch = PrefixCacheWatch(pool)

    def watch(self) -> bool:
        """A prefix-cache reset since the last call: the weights may have been updated
        in place; the workers fingerprint them again before the next plan's jobs.
        Whether a reset was seen."""
        if self.prefix_watch is not None and self.prefix_watch.reset_seen():
            self.scheduler.check_weights()
            return True
        return False

    def handshake(self, metadata: Iterable[object]) -> None:
        """vLLM's handshake, before the first step: the workers' fingerprints at start
        (``WeightsHandshake``; anything else is another connector's, ignored)."""
        self.learn(
            tuple((m.rank, 0, m.fingerprint) for m in metadata if isinstance(m, WeightsHandshake))
        )

    def lora_stamp(self, plan: StepPlan) -> LoraStamp | None:
        """What ``plan``'s loads and stores of requests with an adapter were keyed with."""
        return self.loras.stamp(plan)

    def learn(
        self,
        reports: Iterable[tuple[int, int, bytes]],
        loras: Iterable[tuple[int, int, str]] = (),
    ) -> None:
        """The workers' fingerprints, as ``(rank, check, fingerprint)``, and their
        LoRA adapter loads, as ``(rank, lora_int_id, digest)``."""
        self.loras.learn(loras)
        for rank, check, fingerprint in reports:
            change = self.scheduler.on_weights(rank, check, fingerprint)
            if change is not None and change.changed and not change.first:
                logger.info(
                    "kvoffload: the weights changed (fingerprint %s): KV computed with the "
                    "earlier weights is not served from now on",
                    change.digest.hex()[:16],
                )
