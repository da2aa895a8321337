"""Why a chunk of a tier job did not make it: a typed value, not a parsed string.

Produced by the tier stores (``tiers/disk_store.py``, ``tiers/redis_store.py``) and
the worker's tier lane (``transfer/tier_worker.py``), carried in
:attr:`JobResult.failed_chunks <kvoffload.core.jobs.JobResult.failed_chunks>` (and,
for a tier job none of whose chunks made it, as its ``error``) from the workers to
the scheduler half (pickled across processes: plain frozen dataclass and enum), and
read there by kind (:class:`~kvoffload.core.tiering.planning.TierPlanner`).

``str(failure)`` is the text reasons had before they were typed, kept for log lines
and stats keys: ``"io:<error>"``, ``"integrity:<reason>"`` (``<reason>`` an
:class:`~kvoffload.core.chunk_format.IntegrityReason` value, also the
``kvoffload_integrity_errors_total`` ``reason`` label), ``"missing"``,
``"timeout:<detail>"``, or the error's own text (``"ConnectionError: ..."``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FailureKind(enum.Enum):
    IO = "io"  # the tier's storage failed on this chunk (``detail``: the OS error)
    INTEGRITY = "integrity"  # the tier's copy is corrupt (``detail``: the reason); deleted
    MISSING = "missing"  # the tier no longer holds the chunk (evicted, flushed, expired)
    ERROR = "error"  # the tier failed as a whole (``detail``: the exception, verbatim)
    TIMEOUT = "timeout"  # the tier's I/O ran past its deadline (``detail``: how long); not
    # known bad: the copy is kept, only not served this time; the I/O may still be running


@dataclass(frozen=True)
class ChunkFailure:
    kind: FailureKind
    detail: str = ""

    @property
    def copy_gone(self) -> bool:
        """The tier's copy is proved bad or gone: the scheduler half forgets it."""
        return self.kind is FailureKind.INTEGRITY or self.kind is FailureKind.MISSING

    @property
    def timed_out(self) -> bool:
        """The tier's I/O ran past its deadline: the copy is not known bad (kept), and
        the memory the I/O may still touch is quarantined until it returns."""
        return self.kind is FailureKind.TIMEOUT

    def __str__(self) -> str:
        if self.kind is FailureKind.MISSING:
            return "missing"
        if self.kind is FailureKind.ERROR:
            return self.detail
        return f"{self.kind.value}:{self.detail}"


MISSING = ChunkFailure(FailureKind.MISSING)


def io_failure(error: str) -> ChunkFailure:
    return ChunkFailure(FailureKind.IO, error)


def integrity_failure(reason: str) -> ChunkFailure:
    return ChunkFailure(FailureKind.INTEGRITY, reason)


def error_failure(error: str) -> ChunkFailure:
    return ChunkFailure(FailureKind.ERROR, error)


def timeout_failure(detail: str) -> ChunkFailure:
    return ChunkFailure(FailureKind.TIMEOUT, detail)
