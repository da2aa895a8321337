"""What the scheduler half knows of the weights its engine runs, as an explicit state
machine (decision 0019).

Every worker fingerprints the weights it serves (``adapters/vllm/live_identity.py``:
the live parameters and buffers, the rotary embeddings vLLM built, what passed
through the model's ``load_weights``) and reports the fingerprint with a *check
number*: check 0 once, with its first report after start, and check ``n`` each time
a plan asks for check ``n`` (after a prefix-cache reset, a connector reset: the points
where weights are updated in place). The scheduler half's keys are derived from the
fingerprints it knows (:func:`key_epoch`), so KV computed with other weights is never
found; each plan carries what it knows (:meth:`WeightsState.stamp`), and a worker
whose fingerprint differs from the stamp refuses the plan's loads and stores (the
*fence*): a load planned before a change was learned is recomputed, a store of KV
computed after it is never made readable under the old keys.

::

                all ranks report the latest check
    UNKNOWN ──────────────────────────────────────▶ KNOWN ◀───────────┐
       │ ▲                                          │ ▲ │                │ all ranks report
       └─┘ request_check        a rank reports new  └─┘ │ request_check  │ the latest check
                                                      ▼                │ (changed or not)
                                                   CHECKING ───────────┘
                                                    │ ▲
                                                    └─┘ request_check

A worker whose model's ``load_weights`` ran fingerprints again on its own and
reports under the current check: in KNOWN that one report is a change (KNOWN ->
KNOWN). In UNKNOWN (nothing reported since start: kvoffload under ``MultiConnector``,
whose first report carries the fingerprints) lookups answer *retry later* (bounded by
the deferral limits) and admitted requests are never stored: no keys name weights
yet. In CHECKING the keys stay those of the last fingerprints and lookups are
answered as usual: the plan that asks for the check carries them, and the workers
fingerprint before running any of its jobs, so a load of chunks the weights no longer
match, or a store of KV computed with new weights, is refused there (the fence)
rather than waited for; a reset with unchanged weights (a benchmark's) costs
nothing. A *fixed* state (the reference engine, the simulator: no workers that
fingerprint) is KNOWN for good and ignores checks and reports.

Owned by the scheduler half's façade; mutated only through :meth:`request_check`,
:meth:`report` and :meth:`reset`. Never raises on a report: a report of another check
or another rank than expected is ignored (counted by the caller). Pure Python.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass

from kvoffload.core.errors import IllegalTransition

_EPOCH = b"kvoffload/weights-epoch/v1"
_DIGEST = b"kvoffload/weights/v1"


FENCED = "weights fence: this worker's weights are not the ones the plan's keys name"
"""The error of a load or store a worker refused under the fence (module docstring)."""


class WeightsPhase(enum.Enum):
    UNKNOWN = "unknown"
    KNOWN = "known"
    CHECKING = "checking"


_P = WeightsPhase
TRANSITIONS: dict[tuple[WeightsPhase, WeightsPhase], str] = {
    (_P.UNKNOWN, _P.UNKNOWN): "a check requested before the first reports",
    (_P.UNKNOWN, _P.KNOWN): "every rank reported the latest check",
    (_P.KNOWN, _P.KNOWN): "a worker reported weights loaded anew (its load_weights ran)",
    (_P.KNOWN, _P.CHECKING): "a check requested (prefix-cache or connector reset)",
    (_P.CHECKING, _P.CHECKING): "another check requested before the reports came",
    (_P.CHECKING, _P.KNOWN): "every rank reported the latest check",
}


@dataclass(frozen=True)
class WeightsStamp:
    """What a plan tells its workers: the latest check asked for, and the per-rank
    fingerprints the plan's keys were derived from (None: not known yet, every load
    and store of the plan is refused)."""

    check: int
    expected: tuple[bytes, ...] | None

    def allows(self, rank: int, fingerprint: bytes) -> bool:
        """Whether a worker of ``rank`` whose weights fingerprint is ``fingerprint``
        may run the plan's loads and stores."""
        return (
            self.expected is not None
            and 0 <= rank < len(self.expected)
            and self.expected[rank] == fingerprint
        )


@dataclass(frozen=True)
class WeightsChange:
    """The outcome of the reports that completed a check."""

    first: bool  # the first fingerprints learned since start
    changed: bool  # they differ from the ones known before (always True when first)
    digest: bytes  # the new fingerprints' digest


def weights_digest(fingerprints: tuple[bytes, ...]) -> bytes:
    """One digest of every rank's fingerprint, in rank order (b"" for none)."""
    if not fingerprints:
        return b""
    h = hashlib.blake2b(_DIGEST, digest_size=16)
    for fingerprint in fingerprints:
        h.update(len(fingerprint).to_bytes(4, "little"))
        h.update(fingerprint)
    return h.digest()


def key_epoch(digest: bytes, nonce: bytes) -> bytes:
    """The key epoch of weights ``digest`` after connector resets ``nonce`` (empty
    before the first; random bytes after each, decision 0005). With neither, the
    empty epoch (the reference engine and simulator keep their keys); with a nonce
    only, the nonce itself (a connector reset without fingerprints, as before)."""
    if not digest:
        return nonce
    return hashlib.blake2b(
        _EPOCH + len(digest).to_bytes(4, "little") + digest + nonce, digest_size=16
    ).digest()


class WeightsState:
    """The scheduler half's knowledge of its workers' weights (module docstring)."""

    def __init__(self, ranks: int, *, fixed: bytes | None = None) -> None:
        """``ranks`` workers report; ``fixed``: no worker reports, the weights are
        known for good under this digest (b"": the empty epoch)."""
        self.ranks = ranks
        self.fixed = fixed is not None
        self.phase = WeightsPhase.KNOWN if self.fixed else WeightsPhase.UNKNOWN
        self.fingerprints: tuple[bytes, ...] | None = () if self.fixed else None
        self._digest = fixed or b""
        self.check = 0  # the latest check asked for (0: the report after start)
        self._reported: dict[int, bytes] = {}  # rank -> fingerprint, for ``check``
        self.nonce = b""  # changed by every connector reset (decision 0005)

    @property
    def known(self) -> bool:
        """Some fingerprints are known: keys name weights (current ones, or, while a
        check is out, the last ones; the workers' fence refuses what they no longer
        match)."""
        return self.fingerprints is not None

    @property
    def digest(self) -> bytes:
        return self._digest

    @property
    def epoch(self) -> bytes:
        """The key epoch every chunk key is chained from now."""
        return key_epoch(self._digest, self.nonce)

    def stamp(self) -> WeightsStamp:
        return WeightsStamp(self.check, self.fingerprints)

    def request_check(self) -> None:
        """Ask every worker to fingerprint its weights again (with the next plan)."""
        if self.fixed:
            return
        target = WeightsPhase.UNKNOWN if self.phase is WeightsPhase.UNKNOWN else _P.CHECKING
        self._move(target)
        self.check += 1
        self._reported = {}

    def reset(self, nonce: bytes) -> None:
        """A connector reset: a new ``nonce`` (random bytes: every key changes,
        decision 0005) and, unless fixed, a check (the weights may have changed too)."""
        self.nonce = nonce
        self.request_check()

    def report(self, rank: int, check: int, fingerprint: bytes) -> WeightsChange | None:
        """Rank ``rank`` fingerprinted its weights for check ``check``. Returns the
        change once every rank reported the latest check, else None (also for a
        report of an older check, or of a rank this engine does not have)."""
        if self.fixed or check != self.check or not 0 <= rank < self.ranks:
            return None
        if self.phase is WeightsPhase.KNOWN:  # a worker whose weights were loaded anew
            assert self.fingerprints is not None
            if self.fingerprints[rank] == fingerprint:
                return None
            self._reported = dict(enumerate(self.fingerprints))
        self._reported[rank] = bytes(fingerprint)
        if len(self._reported) < self.ranks:
            return None
        fingerprints = tuple(self._reported[r] for r in range(self.ranks))
        first = self.fingerprints is None
        changed = first or fingerprints != self.fingerprints
        self._move(WeightsPhase.KNOWN)
        self.fingerprints = fingerprints
        self._digest = weights_digest(fingerprints)
        self._reported = {}
        return WeightsChange(first, changed, self._digest)

    def _move(self, target: WeightsPhase) -> None:
        if (self.phase, target) not in TRANSITIONS:
            raise IllegalTransition(f"weights {self.phase.name} -> {target.name} is not allowed")
        self.phase = target
