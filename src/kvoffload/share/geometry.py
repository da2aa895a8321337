"""The share's geometry, fixed by whoever creates it, and its meta file.

``num_slots`` slots of ``slot_bytes`` bytes for each of ``ranks`` tensor-parallel
ranks, evicted by ``policy`` with admission ``store_threshold``. The first engine to
open a share (or ``kvoffload share serve``) fixes it; it is written to the meta file
with the node process's ``generation`` (1 for the first node process, +1 for every
restart) and read back by every later engine and restarted node process, so a share
never changes shape while it exists. An engine whose chunks differ gets a
:class:`ConfigError` when it opens the share (:meth:`ShareGeometry.check_fits`).

The meta file is replaced atomically (written beside it, then renamed).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from kvoffload.core.errors import ConfigError


@dataclass(frozen=True)
class ShareGeometry:
    num_slots: int
    slot_bytes: int
    ranks: int = 1
    policy: str = "lru"
    store_threshold: int = 1
    max_admission_counters: int = 65536
    generation: int = 0

    @classmethod
    def for_budget(
        cls,
        cpu_bytes: int,
        slot_bytes: int,
        ranks: int = 1,
        *,
        policy: str = "lru",
        store_threshold: int = 1,
    ) -> ShareGeometry:
        """The geometry whose slabs, all ranks together, fit in ``cpu_bytes``."""
        for field, value in (("cpu_bytes", cpu_bytes), ("chunk_bytes", slot_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(field, f"must be a positive integer, got {value!r}")
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks <= 0:
            raise ConfigError("tensor_parallel_size", f"must be positive, got {ranks!r}")
        num_slots = cpu_bytes // (slot_bytes * ranks)
        if num_slots <= 0:
            raise ConfigError(
                "cpu_bytes",
                f"{cpu_bytes} B holds no chunk of {slot_bytes} B x {ranks} ranks",
            )
        return cls(num_slots, slot_bytes, ranks, policy, store_threshold)

    def check_fits(self, chunk_bytes: int, rank: int) -> None:
        """An engine whose rank ``rank`` stores chunks of ``chunk_bytes`` bytes can use
        this share, else a :class:`ConfigError` naming what differs."""
        if chunk_bytes != self.slot_bytes:
            raise ConfigError(
                "host_share",
                f"the share holds chunks of {self.slot_bytes} B per rank, this engine's "
                f"are {chunk_bytes} B: use another share name for this model/layout",
            )
        if not 0 <= rank < self.ranks:
            raise ConfigError(
                "host_share",
                f"the share has {self.ranks} tensor-parallel rank(s), this engine has rank {rank}",
            )

    def next_generation(self) -> ShareGeometry:
        return replace(self, generation=self.generation + 1)

    def write(self, path: Path) -> None:
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(asdict(self)))
        os.replace(temporary, path)

    @classmethod
    def read(cls, path: Path) -> ShareGeometry | None:
        """The recorded geometry, or None when there is none (or it is unreadable)."""
        try:
            fields = json.loads(path.read_text())
            policy = str(fields.pop("policy"))
            counts = {name: int(value) for name, value in fields.items()}
            return cls(policy=policy, **counts)
        except (OSError, ValueError, TypeError):
            return None
