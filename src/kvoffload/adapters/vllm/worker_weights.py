"""One worker's side of the weights' identity (decision 0019): its fingerprint, the
checks plans ask for, the fence, and the reports to the scheduler half.

- :meth:`WorkerWeights.open` (at ``register_kv_caches``): the fingerprint source (a
  harness's, else the model vLLM built, :class:`~.live_identity.LiveWeights`) and the
  first fingerprint, reported as check 0 (through vLLM's handshake when kvoffload is
  the engine's connector, :meth:`handshake`, and with the first report either way);
- :meth:`WorkerWeights.admits` (before any job of a plan runs): fingerprint again when
  the plan asks for a newer check or the weights were loaded anew, then whether the
  plan's loads and stores may run (its stamp names this worker's fingerprint);
- :meth:`WorkerWeights.take_reports`: the fingerprints taken since the last report,
  as ``(rank, check, fingerprint)``.

Owned by one worker half; its thread calls it (the wrapped ``load_weights`` only sets
the live weights' dirty flag).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from kvoffload.adapters.vllm.live_identity import (
    UNIDENTIFIED,
    LiveWeights,
    live_weights_source,
)
from kvoffload.adapters.vllm.messages import WeightsHandshake
from kvoffload.core.identity.weights import WeightsStamp

logger = logging.getLogger("kvoffload")


class WorkerWeights:
    def __init__(self) -> None:
        # Harnesses set ``source`` before ``open``; else it is the model vLLM built.
        self.source: Callable[[], bytes] | None = None
        self.rank = 0
        self.fingerprint = b""  # as last taken
        self._live: LiveWeights | None = None
        self._checked = 0  # the latest check a plan asked for, done
        self._loaded = False  # loaded anew, as a harness says (``note_loaded``)
        self._reports: list[tuple[int, int, bytes]] = []  # not yet sent
        self.opened = False

    def open(self, rank: int) -> None:
        """Find the source (unless set) and take the first fingerprint (check 0).
        Called by ``register_kv_caches`` (the model is loaded by then)."""
        self.rank = rank
        if self.source is None:
            self._live = LiveWeights.find()
            self.source = live_weights_source(self._live)
        self._take(0)
        self.opened = True

    def runner(self) -> object | None:
        """vLLM's model runner, as found by :meth:`open` (None: a harness's source, or
        not found)."""
        return self._live.runner() if self._live is not None else None

    @property
    def dirty(self) -> bool:
        """Weights were loaded anew since the last fingerprint (through the model's
        ``load_weights``, or as a harness says)."""
        return self._loaded or (self._live is not None and self._live.dirty)

    def note_loaded(self) -> None:
        """The weights were loaded anew (what the wrapped ``load_weights`` notes by
        itself; harnesses with a fake model call this)."""
        self._loaded = True

    def admits(self, stamp: WeightsStamp) -> bool:
        """Before the plan stamped ``stamp`` runs any job: fingerprint again if it asks
        for a newer check or the weights were loaded anew; whether its loads and
        stores may run."""
        if stamp.check > self._checked or self.dirty:
            self._take(max(stamp.check, self._checked))
        return stamp.allows(self.rank, self.fingerprint)

    def handshake(self) -> WeightsHandshake | None:
        """The fingerprint taken at start, for vLLM's handshake (None before)."""
        return WeightsHandshake(self.rank, self.fingerprint) if self.opened else None

    def take_reports(self) -> tuple[tuple[int, int, bytes], ...]:
        reports, self._reports = tuple(self._reports), []
        return reports

    def _take(self, check: int) -> None:
        assert self.source is not None
        self._loaded = False
        try:
            self.fingerprint = self.source()
        except Exception as exc:  # a model kvoffload cannot read: never fail the worker
            if self.fingerprint != UNIDENTIFIED:
                logger.warning(
                    "kvoffload: the weights could not be fingerprinted (%s); weights updated "
                    "in place are not detected: reset the connector after an update",
                    exc,
                )
            self.fingerprint = UNIDENTIFIED
        self._checked = check
        self._reports.append((self.rank, check, self.fingerprint))
