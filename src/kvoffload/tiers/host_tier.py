"""The host-memory tier, declared (:data:`HOST`): its slots, its directory and
store, private or shared by the engines of a node, its start-up text and its
simulator lane.

Every engine has it, first of its tiers: what it stores goes to host memory, what it
loads comes from there or from a lower tier. Its options are the engine's own
(``cpu_bytes``, ``eviction``, ``store_threshold``, the ``host_share*`` options:
``core/config/own_options.py``), so its config section is empty.

- Private (no ``host_share``): its directory lives in the scheduler half
  (:class:`~kvoffload.core.directory.Directory`), its slots in each worker's own
  slab (:class:`~kvoffload.tiers.host.HostSlab`).
- Shared (``host_share``: decision 0016): its directory lives in the share's node
  process over shared-memory slabs
  (:class:`~kvoffload.share.memory_backing.MemoryBacking`); each worker maps its
  rank's slab (:class:`~kvoffload.tiers.host_shared.SharedHostSlab`), and every plan
  names the slab its bookings are in (decision 0018).

Which of the two is :func:`node_share`'s answer, taken by the build
(:mod:`kvoffload.tiers.build`) as for any other tier. Importing this module imports
nothing heavy; builders import what they use.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from kvoffload.core.config.capacity import host_slots
from kvoffload.core.config.sections import ConfigSection, OptionValues
from kvoffload.tiers.spec import Locality, OpenedIndex, SimLane, TierContext, TierSpec

if TYPE_CHECKING:
    from kvoffload.core.directory import HostDirectory
    from kvoffload.tiers.node_shares import NodeShare
    from kvoffload.tiers.slot_rows import SlotRows


def enabled(config: OptionValues) -> bool:
    """Host memory is always on."""
    return True


def slots(config: OptionValues, chunk_bytes: int, world_size: int) -> int:
    """Host slots per rank that ``cpu_bytes`` (all ranks together) holds: one slot
    holds one rank's share of a chunk; ``ConfigError`` naming ``cpu_bytes`` when not
    even one fits (:func:`~kvoffload.core.config.capacity.host_slots`)."""
    return host_slots(config.option("cpu_bytes"), chunk_bytes, world_size)


def open_index(config: OptionValues, ctx: TierContext) -> OpenedIndex[HostDirectory]:
    """The engine's own host directory of ``ctx.slots`` slots."""
    from kvoffload.core.directory import Directory

    directory = Directory(
        ctx.slots,
        tier="host",
        policy=ctx.eviction,
        store_threshold=config.option("store_threshold"),
    )
    return OpenedIndex(directory)


def open_store(config: OptionValues, ctx: TierContext) -> SlotRows:
    """This worker's own slab: ``ctx.slots`` slots of ``ctx.chunk_bytes``."""
    from kvoffload.tiers.host import HostSlab

    return HostSlab(ctx.chunk_bytes, ctx.slots * ctx.chunk_bytes)


def node_share(config: OptionValues, ctx: TierContext) -> NodeShare | None:
    """The host share ``host_share`` names (None: private host memory): shared-memory
    slabs under ``host_share_root``, created with ``cpu_bytes`` by the first engine
    (a share keeps its creator's size, policy and admission)."""
    name = config.option("host_share")
    if name is None:
        return None
    from kvoffload.core.private_files import resolve_group
    from kvoffload.share.memory_backing import MemoryBacking
    from kvoffload.share.meta import ShareGeometry
    from kvoffload.tiers.node_shares import NodeShare

    backing = MemoryBacking(str(name))
    geometry = ShareGeometry.for_budget(
        config.option("cpu_bytes"), ctx.chunk_bytes, ctx.world_size,
        policy=config.option("eviction"), store_threshold=config.option("store_threshold"),
    )  # fmt: skip

    def check(recorded: ShareGeometry) -> None:
        for rank in range(ctx.world_size):
            recorded.check_fits(ctx.chunk_bytes, rank)

    return NodeShare(
        backing,
        backing.paths(Path(str(config.option("host_share_root"))),
                      resolve_group(config.option("host_share_group"))),
        geometry,
        timeout_s=float(config.option("host_share_timeout_ms")) / 1000,
        what=f"share {name!r}",
        bind_plans=True,  # every plan names the slab its jobs move bytes of
        check=check,
    )  # fmt: skip


def open_shared_store(config: OptionValues, ctx: TierContext, share: NodeShare) -> SlotRows:
    """This worker's rank slab of the host share, and its lease (``ConfigError`` when
    the engine's chunks do not fit the share)."""
    from kvoffload.tiers.host_shared import SharedHostSlab

    return SharedHostSlab(share, chunk_bytes=ctx.chunk_bytes, rank=ctx.rank)


def describe(config: OptionValues, chunks: int) -> str:
    from kvoffload.inspection.render import human_bytes

    return f"host {human_bytes(config.option('cpu_bytes'))} = {chunks} chunks"


def _identity(directory: HostDirectory) -> HostDirectory:
    """Host memory's index over a shared directory is the directory itself."""
    return directory


HOST: TierSpec[HostDirectory, SlotRows] = TierSpec(
    name="host",
    medium="CPU",
    locality=Locality.LOCAL,
    section=ConfigSection(()),
    enabled=enabled,
    slots=slots,
    open_index=open_index,
    open_store=open_store,
    describe=describe,
    node_share=node_share,
    open_shared_store=open_shared_store,
    over_directory=_identity,
    sim=SimLane(
        gbps=25.0,  # PCIe Gen4 x16, each direction
        bytes_help="host memory (--cpu-bytes)",
        gbps_help="engine<->host GB/s",
    ),
    inspect=None,
)
