"""A tier's namespace records (:mod:`kvoffload.core.identity.namespace_record`), for
any tier: how a tier keeps one (:class:`NamespaceRecords`, its spec's
:attr:`~kvoffload.tiers.spec.TierSpec.records`; each tier's in its own module, e.g.
``tiers/disk_record.py``, ``tiers/redis_record.py``), and writing or reading one
that way (:func:`record_namespace`, :func:`read_namespace_record`).

The scheduler half writes the record once at start, where its index opened the tier:
never on the hot path. A failed write is logged, never raised: a record is
informational, the engine never reads it; ``kvoffload inspect`` shows a namespace
without a readable record as "fields unknown". Imports no tier.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvoffload.core.keys import Namespace

__all__ = ["NamespaceRecords", "read_namespace_record", "record_namespace"]

logger = logging.getLogger("kvoffload")


@dataclass(frozen=True)
class NamespaceRecords:
    """How one tier keeps a namespace's record at its location ``where`` (what the
    tier's index opens: a disk tier's root directory, a Redis client; the caller owns
    it). ``label`` names the tier in the warning of a failed write; ``write`` writes
    ``namespace``'s record there, replacing the one it had (raises the location's
    errors: ``OSError``, the client's); ``read`` returns the fields recorded for the
    namespace of digest hex ``digest_hex`` there, or None when there is no readable,
    valid record (raises only what says the location failed as a whole, e.g. a
    client's connection error). Neither keeps state."""

    label: str
    write: Callable[[Any, Namespace], object]
    read: Callable[[Any, str], dict[str, str] | None]


def record_namespace(records: NamespaceRecords | None, where: Any, namespace: Namespace) -> None:
    """Write ``namespace``'s record into ``where`` as ``records`` (a tier spec's
    :attr:`~kvoffload.tiers.spec.TierSpec.records`) keep it; nothing for None (a tier
    without records). A failure is logged, never raised: the record only serves
    ``kvoffload inspect``."""
    if records is None:
        return
    try:
        records.write(where, namespace)
    except Exception as exc:
        logger.warning(
            "kvoffload: could not record namespace %s in the %s tier (%s: %s); "
            "kvoffload inspect will show its fields as unknown",
            namespace.digest().hex(),
            records.label,
            type(exc).__name__,
            " ".join(str(exc).split())[:200],
        )


def read_namespace_record(
    records: NamespaceRecords | None, where: Any, digest_hex: str
) -> dict[str, str] | None:
    """The fields recorded in ``where`` for the namespace ``digest_hex`` as ``records``
    keep them; None without a readable, valid record or for None (a tier without
    records). See :class:`NamespaceRecords` for what may raise."""
    return None if records is None else records.read(where, digest_hex)
