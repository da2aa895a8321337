"""The disk tier, declared (:data:`DISK`): its options, its index and stores, its
start-up text, its simulator lane and its ``kvoffload inspect disk`` command.

A bounded, authoritative, slotted tier: one preallocated slab file per rank under
``disk_path`` (``tiers/disk.py``). Without a host share it is local to one engine,
booked in the scheduler half's own directory rebuilt from the slabs at start
(``tiers/disk_index.py``); one engine per namespace directory: the scheduler half
holds its lock from opening the index to closing it (``tiers/disk_lock.py``), each
worker checks it before opening its store. Shared (``disk_share``: with a host
share by default), every engine of the node naming the same ``disk_path`` shares it
through a node process of its own (:func:`node_share`, ``tiers/disk_node.py``,
decision 0017), opened by the build as any node-shared tier.

Importing this module imports nothing heavy; builders import the tier's modules.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvoffload.codecs import tier_codec_option
from kvoffload.core.config.sections import (
    ConfigSection,
    Option,
    OptionValues,
    int_at_least,
    is_bool,
    optional,
)
from kvoffload.core.errors import ConfigError
from kvoffload.tiers.disk_record import DISK_RECORDS
from kvoffload.tiers.spec import (
    InspectCommand,
    Locality,
    OpenedIndex,
    SimLane,
    TierContext,
    TierSpec,
    TierStore,
)

if TYPE_CHECKING:
    from kvoffload.core.tiering.lower import LowerTier
    from kvoffload.tiers.node_shares import NodeShare

logger = logging.getLogger("kvoffload")


def _together(values: Mapping[str, Any]) -> None:
    if (values["disk_path"] is None) != (values["disk_bytes"] is None):
        missing = "disk_bytes" if values["disk_bytes"] is None else "disk_path"
        raise ConfigError(missing, "disk_path and disk_bytes go together")


SECTION = ConfigSection(
    (
        Option(
            "disk_path",
            "a directory path (created owner-only if missing)",
            None,
            "Enables the local-disk tier below host memory, with chunk files under this "
            "directory. Needs disk_bytes.",
            lambda v: v is None or (isinstance(v, str) and bool(v)),
        ),
        Option(
            "disk_bytes",
            "integer >= 1",
            None,
            "Capacity of the disk tier in bytes, all workers together; the least valuable "
            "chunks are evicted (by the eviction policy) beyond it.",
            optional(int_at_least(1)),
        ),
        Option(
            "disk_share",
            "auto | node | off",
            "auto",
            "Share the disk tier with every engine of the node that names the same "
            "disk_path (same model): one directory of its chunks, kept by a node process "
            "of its own (decision 0017; its files in host_share_root, its calls' deadline "
            "host_share_timeout_ms). auto: shared when a host_share is named; node: "
            "always; off: this engine's own (a second engine on the path is refused).",
            lambda v: v in ("auto", "node", "off"),
        ),
        Option(
            "disk_o_direct",
            "true | false",
            False,
            "Read and write chunk files with O_DIRECT (bypass the page cache).",
            is_bool,
        ),
        tier_codec_option("disk"),
        Option(
            "disk_seal",
            "true | false",
            False,
            "With seal_key_file: seal the disk tier's chunks too (a disk_path on storage "
            "other machines or users can reach, e.g. a network file system; decision "
            "0024). A local disk of this user's own needs no seal.",
            is_bool,
        ),
    ),
    _together,
)


def enabled(config: OptionValues) -> bool:
    return config.option("disk_path") is not None


def shared(config: OptionValues) -> bool:
    """Whether the disk tier is shared by the node's engines through a node process
    (``disk_share``: ``node``, or ``auto`` with a host share)."""
    mode = config.option("disk_share")
    return enabled(config) and (
        mode == "node" or (mode == "auto" and config.option("host_share") is not None)
    )


def slots(config: OptionValues, chunk_bytes: int, world_size: int) -> int:
    """Chunk files per rank that ``disk_bytes`` holds (each with its header)."""
    from kvoffload.tiers.disk import slot_bytes

    file_bytes = slot_bytes(chunk_bytes)
    capacity: int = config.option("disk_bytes")
    count = capacity // (file_bytes * world_size)
    if count < 1:
        raise ConfigError(
            "disk_bytes",
            f"invalid value {capacity}; accepted: at least one chunk file per "
            f"worker, {file_bytes * world_size} bytes here",
        )
    return count


def open_index(config: OptionValues, ctx: TierContext) -> OpenedIndex[LowerTier]:
    """The disk's directory, rebuilt from the slabs, under the namespace's lock (a
    second engine on the namespace: ``ConfigError``); its namespace record written."""
    from kvoffload.core.directory import Directory
    from kvoffload.tiers.disk_files import disk_policy, private_namespace_dir
    from kvoffload.tiers.disk_index import open_disk_tier
    from kvoffload.tiers.disk_lock import DiskLock
    from kvoffload.tiers.namespace_records import record_namespace
    from kvoffload.tiers.record_log import RecordLog

    root = Path(config.option("disk_path"))
    digest = ctx.namespace.digest()
    lock = DiskLock.acquire(root, digest)
    try:
        index, recovery = open_disk_tier(
            root, digest, ctx.world_size, ctx.slots, ctx.chunk_bytes, policy=ctx.eviction
        )
    except BaseException:
        lock.release()
        raise
    logger.info(
        "kvoffload: disk tier at %s: %d chunks recovered, %d copies ignored",
        root, recovery.adopted, recovery.ignored,
    )  # fmt: skip
    record_namespace(DISK_RECORDS, root, ctx.namespace)
    directory = index.directory
    assert isinstance(directory, Directory)  # a private engine's own
    records = RecordLog(private_namespace_dir(root, digest), disk_policy(root),
                        directory.present_keys)  # fmt: skip

    def close() -> None:
        records.close()
        lock.release()

    return OpenedIndex(index, close, records)


def open_store(config: OptionValues, ctx: TierContext) -> TierStore:
    """This rank's slab (refused while another engine holds the namespace)."""
    from kvoffload.tiers.disk import DiskStore
    from kvoffload.tiers.disk_lock import check_workers_engine
    from kvoffload.tiers.disk_store import DiskTierStore

    root = Path(config.option("disk_path"))
    digest = ctx.namespace.digest()
    check_workers_engine(root, digest)
    store = DiskStore(
        root,
        digest,
        ctx.rank,
        ctx.chunk_bytes,
        ctx.slots,
        o_direct=config.option("disk_o_direct"),
        groups=ctx.groups,
    )
    return DiskTierStore(store)


def node_share(config: OptionValues, ctx: TierContext) -> NodeShare | None:
    """The node's disk share of ``disk_path`` when ``disk_share`` says so (None: this
    engine's own disk tier)."""
    if not shared(config):
        return None
    from kvoffload.tiers.disk_node import node_share as disk_share

    return disk_share(config, ctx)


def open_shared_store(config: OptionValues, ctx: TierContext, share: NodeShare) -> TierStore:
    """This rank's slab of the node's disk share, and its lease."""
    from kvoffload.tiers.disk_node import open_shared_store as open_slab

    return open_slab(config, ctx, share)


def describe(config: OptionValues, chunks: int) -> str:
    from kvoffload.inspection.render import human_bytes

    text = f"disk {config.option('disk_path')} {human_bytes(config.option('disk_bytes'))}"
    text += f" = {chunks} chunks"
    if shared(config):
        text += " (shared by the node's engines)"
    return text + (" O_DIRECT" if config.option("disk_o_direct") else "")


def worker_notes(config: OptionValues, store: TierStore) -> None:
    """Warn when O_DIRECT was asked for and the filesystem refused it."""
    from kvoffload.tiers.disk_store import DiskTierStore

    refused = isinstance(store, DiskTierStore) and not store.store.o_direct
    if config.option("disk_o_direct") and refused:
        logger.warning(
            "kvoffload: disk_o_direct is set but the filesystem of %s refuses O_DIRECT; "
            "the disk tier uses buffered I/O",
            config.option("disk_path"),
        )


def _inspect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path",
        metavar="PATH",
        help="the tier's directory (the one holding kvoffload-v1/), kvoffload-v1/ "
        "itself, or one namespace directory",
    )


def _inspect(args: argparse.Namespace) -> Any:
    from kvoffload.inspection.disk_scan import inspect_disk

    return inspect_disk(Path(args.path), args.namespace, args.verify, args.world_size)


DISK: TierSpec[LowerTier, TierStore] = TierSpec(
    name="disk",
    medium="STORAGE",
    locality=Locality.LOCAL,
    section=SECTION,
    enabled=enabled,
    slots=slots,
    open_index=open_index,
    open_store=open_store,
    describe=describe,
    worker_notes=worker_notes,
    node_share=node_share,
    open_shared_store=open_shared_store,
    sim=SimLane(
        gbps=3.0,  # one NVMe SSD
        bytes_help="disk tier capacity (default 0: none)",
        gbps_help="disk tier bandwidth, both directions",
    ),
    inspect=InspectCommand(
        help="a disk tier directory",
        description="Inspect a disk tier directory (read-only): the slab file of each "
        "namespace and rank, its used slots and capacity, complete chunks (every rank "
        "holds the chunk in the same slot, as start-up recovery requires) and bad slab "
        "files.",
        verify_help="read every used slot in full and check header and checksum, as the "
        "disk tier's reader does; exit status 1 if any slot or slab file is bad",
        world_help="ranks per chunk (a chunk is complete when ranks 0..N-1 all hold it in "
        "the same slot); default: the highest rank of a slab file + 1",
        add=_inspect_arguments,
        run=_inspect,
    ),
    records=DISK_RECORDS,
    seals=lambda config: bool(config.option("disk_seal")),  # a disk on shared storage
)
