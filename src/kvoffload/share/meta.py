"""The share's geometry, fixed by whoever creates it, and its meta file.

``num_slots`` slots of ``slot_bytes`` bytes for each of ``ranks`` tensor-parallel
ranks, evicted by ``policy`` with admission ``store_threshold``. The first engine to
open a share (or ``kvoffload share serve``) fixes it; it is written to the meta file
with the node process's ``generation`` (1 for the first node process, +1 for every
restart) and read back by every later engine and restarted node process, so a share
never changes shape while it exists. An engine whose chunks differ gets a
:class:`ConfigError` when it opens the share (:meth:`ShareGeometry.check_fits`).

``slab_id`` (16 random bytes) names the incarnation of the share's slab files: the
same in every rank's slab header and in the meta file, kept by a node process that
keeps the files, new whenever they are made anew (:mod:`.slab_files`). A node process
is identified by ``(generation, slab_id)``: after the share's directory was deleted
wholesale its successor counts generations from 1 again, with another slab id.

The meta file is replaced atomically (written beside it, then renamed) and read only
when it passes the checks of :mod:`kvoffload.core.private_files` (else it is treated as absent).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace

from kvoffload.core.config.capacity import slots_per_rank
from kvoffload.core.config.own_options import default
from kvoffload.core.directory.admission import MAX_ADMISSION_COUNTERS
from kvoffload.core.errors import ConfigError
from kvoffload.core.private_files import read_checked, replace_atomically
from kvoffload.share.paths import SharePaths


@dataclass(frozen=True)
class ShareGeometry:
    num_slots: int
    slot_bytes: int
    ranks: int = 1
    policy: str = default("eviction")
    store_threshold: int = default("store_threshold")
    max_admission_counters: int = MAX_ADMISSION_COUNTERS
    generation: int = 0
    slab_id: bytes = b""

    @classmethod
    def for_budget(
        cls,
        cpu_bytes: int,
        slot_bytes: int,
        ranks: int = 1,
        *,
        policy: str = default("eviction"),
        store_threshold: int = default("store_threshold"),
    ) -> ShareGeometry:
        """The geometry whose slabs, all ranks together, fit in ``cpu_bytes``."""
        for field, value in (("cpu_bytes", cpu_bytes), ("chunk_bytes", slot_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(field, f"must be a positive integer, got {value!r}")
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks <= 0:
            raise ConfigError("tensor_parallel_size", f"must be positive, got {ranks!r}")
        num_slots = slots_per_rank(cpu_bytes, slot_bytes, ranks)
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

    def with_slab_id(self, slab_id: bytes) -> ShareGeometry:
        return replace(self, slab_id=slab_id)

    def write(self, paths: SharePaths) -> None:
        """Replace the share's meta file with this geometry (node process only)."""
        fields = {**asdict(self), "slab_id": self.slab_id.hex()}
        data = json.dumps(fields).encode()
        replace_atomically(paths.meta, paths.policy, lambda fd: _write_all(fd, data))

    @classmethod
    def read(cls, paths: SharePaths) -> ShareGeometry | None:
        """The recorded geometry, or None when there is none (or it is unreadable, or
        fails the checks of :mod:`kvoffload.core.private_files`: a file another user
        could have made)."""
        try:
            fields = json.loads(read_checked(paths.meta, paths.policy))
            policy = str(fields.pop("policy"))
            slab_id = bytes.fromhex(str(fields.pop("slab_id", "")))
            counts = {name: int(value) for name, value in fields.items()}
            return cls(policy=policy, slab_id=slab_id, **counts)
        except (OSError, ValueError, TypeError):
            return None


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
