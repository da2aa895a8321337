"""The fuzzer's sealing draw (issue 41, decision 0024): which seeds seal their lower
tier, and the forgeries another client of the store makes.

A seed with a lower tier seals it with a share of :data:`SEAL_SHARE` (a stream of the
seed's own: every seed keeps its other draws): a key file in the seed's work
directory, ``seal_key_file`` set, and ``disk_seal`` for the disk tier. Most sealed
seeds also draw :attr:`~.scenario.FaultKind.FORGED`: the sealed chunks a share of
writes carry are rewritten before the tier stores them, one ciphertext byte negated,
and the tier then writes its own header and checksum over them, valid (as a client of
the store who knows kvoffload's format rewrites a value). Only the seal can tell; a
forged chunk that opened would put wrong KV in the engine, which the harness's model
finds on its next read (``vllm_harness/kv_model.py``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvoffload.core.failures import ChunkFailure
from kvoffload.core.keys import ChunkKey
from kvoffload.sealing.keyfile import write_new
from kvoffload.sealing.layout import PREFIX_BYTES
from kvoffload.sealing.store import SealedStore
from kvoffload.transfer.tier_worker import TierWorker

SEAL_SHARE = 0.3
"""Share of seeds with a lower tier that seal it."""
FORGED_SHARE = 0.8
"""Share of sealed seeds whose store's chunks are forged now and then."""


def draw_sealing(seed: int) -> tuple[bool, float]:
    """``(sealed, forged rate)`` of ``seed`` if it has a lower tier."""
    rng = random.Random(f"kvoffload-vllm-fuzz-sealing:{seed}")
    if rng.random() >= SEAL_SHARE:
        return False, 0.0
    if rng.random() >= FORGED_SHARE:
        return True, 0.0
    return True, rng.choice((0.1, 0.3, 1.0))


def seal_options(tier: str | None, workdir: Path) -> dict[str, Any]:
    """kvoffload's options sealing ``tier`` with a key file in ``workdir`` (made there
    by the first call)."""
    if tier is None:
        return {}
    key = workdir / "seal.key"
    if not key.exists():
        write_new(key)
    return {"seal_key_file": str(key), **({"disk_seal": True} if tier == "disk" else {})}


class ForgedWrites:
    """A sealed tier's own store, with the sealed chunks ``forged(key)`` selects
    rewritten (one ciphertext byte negated) before the store writes its format over
    them (see the module docstring). ``count``: chunks forged."""

    def __init__(self, inner: Any, forged: Callable[[ChunkKey], bool]) -> None:
        self.inner = inner
        self.forged = forged
        self.count = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def write_many(
        self,
        items: Sequence[tuple[ChunkKey, memoryview]],
        slots: Sequence[int],
        groups: Sequence[int] = (),
    ) -> list[ChunkFailure | None]:
        written: list[tuple[ChunkKey, memoryview]] = []
        for key, sealed in items:
            out = sealed
            if self.forged(key) and len(sealed) > PREFIX_BYTES:
                copy = bytearray(sealed)
                copy[PREFIX_BYTES + (len(copy) - PREFIX_BYTES) // 3] ^= 0xFF
                out = memoryview(copy)
                self.count += 1
            written.append((key, out))
        failures: list[ChunkFailure | None] = self.inner.write_many(written, slots, groups)
        return failures


def sealed_store(store: Any) -> SealedStore | None:
    """The :class:`SealedStore` in a worker's tier store (under a codec's), if any."""
    while store is not None and not isinstance(store, SealedStore):
        store = getattr(store, "__dict__", {}).get("inner")
    return store


def _for_rank(forged: Callable[[int, ChunkKey], bool], rank: int) -> Callable[[ChunkKey], bool]:
    return lambda key: forged(rank, key)


def forge_sealed_writes(
    lanes: Sequence[tuple[int, Any]], forged: Callable[[int, ChunkKey], bool]
) -> int:
    """Put :class:`ForgedWrites` under every sealed store of the workers' tier lanes
    (``(rank, lane)``); the stores wrapped."""
    wrapped = 0
    for rank, lane in lanes:
        if not isinstance(lane, TierWorker):
            continue
        for store in lane.stores.values():
            sealed = sealed_store(store)
            if sealed is not None and not isinstance(sealed.inner, ForgedWrites):
                sealed.inner = ForgedWrites(sealed.inner, _for_rank(forged, rank))
                wrapped += 1
    return wrapped
