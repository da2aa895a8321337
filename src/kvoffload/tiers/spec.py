"""What a tier declares about itself: one :class:`TierSpec` per tier, in the tier's
own module (``tiers/host_tier.py``, ``tiers/disk_tier.py``, ``tiers/redis_tier.py``),
listed once in :mod:`kvoffload.tiers.registry`.

A spec names everything the rest of kvoffload needs to know of a tier, so that no
module outside ``tiers/`` (and the test support, and ``inspection/``) names one:

- its config section (:attr:`TierSpec.section`: the options a user writes, their
  checks and docs text; read by :mod:`kvoffload.core.config.typed`);
- its medium and locality as vLLM's KV events name them (whether the tier announces
  removals);
- the scheduler half's index (:attr:`TierSpec.open_index`: for host memory a
  directory, for a lower tier a :class:`~kvoffload.core.tiering.lower.LowerTier`,
  with what must be closed after it) and one worker's store
  (:attr:`TierSpec.open_store`: the host slots, or a lower tier's :class:`TierStore`);
- whether a configuration shares the tier's directory with the engines of a node
  (:attr:`TierSpec.node_share`: a :class:`~kvoffload.tiers.node_shares.NodeShare`,
  or None), and then one worker's store over the share
  (:attr:`TierSpec.open_shared_store`) and the index over the share's directory
  (:attr:`TierSpec.over_directory`): the build (:mod:`kvoffload.tiers.build`) makes
  that one choice for every tier;
- its capacity in chunks (:attr:`TierSpec.slots`; 0 for a tier keyed by chunk whose
  capacity is its server's);
- its start-up text (:attr:`TierSpec.describe`) and start-up warnings
  (:attr:`TierSpec.warn`);
- its lane in the simulator (:attr:`TierSpec.sim`);
- its ``kvoffload inspect`` subcommand (:attr:`TierSpec.inspect`; None: none);
- where it keeps a namespace's record for ``kvoffload inspect``
  (:attr:`TierSpec.records`, a :class:`~kvoffload.tiers.namespace_records.NamespaceRecords`;
  None: none).

Importing a spec module imports nothing heavy (no torch, numpy or client library):
builders import what they use when called. Specs are frozen and shared.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, runtime_checkable

from kvoffload.core.config.own_options import default
from kvoffload.core.config.sections import ConfigSection, OptionValues
from kvoffload.core.failures import ChunkFailure
from kvoffload.core.keys import ChunkKey, Namespace
from kvoffload.tiers.namespace_records import NamespaceRecords

if TYPE_CHECKING:
    import argparse

    from kvoffload.core.directory import HostDirectory
    from kvoffload.tiers.node_shares import NodeShare
    from kvoffload.tiers.record_log import RecordLog

I = TypeVar("I")  # noqa: E741  (the scheduler half's index of the tier)
S = TypeVar("S")  # one worker's store of the tier


class Locality(enum.Enum):
    """Who else reads a tier: only this engine (``LOCAL``), or other engines too
    (``REMOTE``: a shared server; it evicts by itself, so removals are not announced)."""

    LOCAL = "LOCAL"
    REMOTE = "REMOTE"


class TierStore(Protocol):
    """One rank's share of a lower tier, as the worker's tier lane uses it. ``slots``
    are the chunks' tier slots (slotted tiers; empty for tiers keyed by chunk);
    ``groups`` their KV cache groups (the job's
    :attr:`~kvoffload.core.jobs.TierJob.groups`; empty: all 0), written with each chunk
    and expected back when it is read (a chunk of another group fails as
    ``integrity:group``). Both return one :class:`ChunkFailure` per chunk (None: done)
    and raise only when the tier failed as a whole (connection refused, timeout). A
    chunk missing, corrupt or stored under another key is a failed chunk, never an
    exception."""

    def write_many(
        self,
        items: Sequence[tuple[ChunkKey, memoryview]],
        slots: Sequence[int],
        groups: Sequence[int] = (),
    ) -> list[ChunkFailure | None]: ...

    def read_many(
        self,
        keys: Sequence[ChunkKey],
        slots: Sequence[int],
        outs: Sequence[memoryview],
        groups: Sequence[int] = (),
    ) -> list[ChunkFailure | None]: ...


@dataclass(frozen=True)
class TierContext:
    """What a tier's builders are given besides the configuration: the engine's
    namespace, its ranks, one rank's chunk bytes, the tier's capacity in chunks (from
    :attr:`TierSpec.slots`), the layout's KV cache groups, the eviction policy,
    (worker side) the rank that opens a store, and (scheduler side, with a host share)
    the engine's session id, which a tier kept by a node process books under."""

    namespace: Namespace
    world_size: int
    chunk_bytes: int
    slots: int
    groups: int = 1
    eviction: str = default("eviction")
    rank: int = 0
    session: bytes | None = None  # scheduler side, with a host share: the engine's session


@runtime_checkable
class SessionHolder(Protocol):
    """A worker's tier store that books under its engine's session at a node process
    (a node-shared tier): it must hold a lease on the session each plan names before
    running any job of that plan (``hold`` is idempotent; a new session replaces the
    old), and release it when closed, after its copies."""

    def hold(self, session: bytes | None) -> None: ...


def _nothing() -> None:
    return None


@dataclass
class OpenedIndex(Generic[I]):
    """A tier's scheduler-side index, opened: ``close`` releases what opening took
    (a lock, a thread, a node share's connections); called once, at shutdown or when
    opening a later tier failed."""

    index: I
    close: Callable[[], None] = _nothing
    records: RecordLog | None = None  # a persistent tier's announcement records


@dataclass(frozen=True)
class SimLane:
    """The tier in ``kvoffload simulate``: its read/write bandwidth by default (GB/s,
    ``--<name>-gbps``), the help texts of its two arguments, and whether it is keyed
    by chunk (``keyed``: a variable-size chunk, lossless, takes its own size there;
    else a slot of a fixed size, decision 0023)."""

    gbps: float
    bytes_help: str
    gbps_help: str
    keyed: bool = False


@dataclass(frozen=True)
class InspectCommand:
    """The tier's ``kvoffload inspect <name>`` subcommand: its one-line ``help`` and
    ``description``; the help of the options every tier's subcommand has
    (``--verify``, ``--world-size``); ``add`` declares the tier's own arguments (its
    location first); ``run`` scans read-only and returns the report (an
    :class:`~kvoffload.inspection.model.Report`; raises ``UsageError``)."""

    help: str
    description: str
    verify_help: str
    world_help: str
    add: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], Any]


def _no_warning(config: OptionValues) -> None:
    return None


def _never(config: OptionValues) -> bool:
    return False


def _no_note(config: OptionValues, store: Any) -> None:
    return None


def _private(config: OptionValues, ctx: TierContext) -> NodeShare | None:
    return None


def _not_shareable(config: OptionValues, ctx: TierContext, share: NodeShare) -> Any:
    raise AssertionError("a tier that is never shared has no shared store")


def _over_directory(directory: HostDirectory) -> Any:
    """A lower tier booked in a directory (:class:`~kvoffload.core.tiering.lower.DirectoryTier`)."""
    from kvoffload.core.tiering.lower import DirectoryTier

    return DirectoryTier(directory)


@dataclass(frozen=True)
class TierSpec(Generic[I, S]):
    """One tier, declared (see the module docstring). ``name`` is the tier's label
    everywhere (metrics, events, jobs, request controls); ``medium`` and
    ``locality`` its labels in vLLM's KV events; ``section`` its config section;
    ``enabled`` whether a configuration turns it on; ``slots`` its capacity in
    chunks for a chunk of ``chunk_bytes`` on each of ``world_size`` ranks (raises
    ``ConfigError`` naming the option when not even one fits; 0: unbounded, keyed by
    chunk); ``open_index`` (scheduler half, once per engine) and ``open_store``
    (each worker, its rank's share) open a private tier and raise ``ConfigError``
    for a configuration the tier refuses; ``node_share`` says whether the
    configuration shares the tier's directory with the node's engines (then the
    build opens the share's directory, ``over_directory`` makes the tier's index of
    it, and ``open_shared_store`` opens a worker's store over it: the scheduler half
    draws a session, books under it and names it in every plan's metadata);
    ``describe`` its part of the scheduler's start-up line; ``warn`` logs its
    start-up warnings (never raises); ``settle`` checks, when the engine starts,
    what needs the environment (files, variables) without connecting; ``records``
    where the tier keeps a namespace's record (written as its index opens, with
    :func:`~kvoffload.tiers.namespace_records.record_namespace`; None: none);
    ``seals`` whether, with ``seal_key_file`` set, the configuration seals the tier's
    chunks (a store other processes or machines reach; decision 0024: the build then
    opens the tier for sealed chunks and wraps its store in a
    :class:`~kvoffload.sealing.store.SealedStore`)."""

    name: str
    medium: str
    locality: Locality
    section: ConfigSection
    enabled: Callable[[OptionValues], bool]
    slots: Callable[[OptionValues, int, int], int]
    open_index: Callable[[OptionValues, TierContext], OpenedIndex[I]]
    open_store: Callable[[OptionValues, TierContext], S]
    describe: Callable[[OptionValues, int], str]
    sim: SimLane
    inspect: InspectCommand | None
    warn: Callable[[OptionValues], None] = _no_warning
    settle: Callable[[OptionValues], None] = _no_warning
    worker_notes: Callable[[OptionValues, S], None] = _no_note
    node_share: Callable[[OptionValues, TierContext], NodeShare | None] = _private
    open_shared_store: Callable[[OptionValues, TierContext, NodeShare], S] = _not_shareable
    over_directory: Callable[[HostDirectory], I] = _over_directory
    records: NamespaceRecords | None = None
    seals: Callable[[OptionValues], bool] = _never

    @property
    def announces_removals(self) -> bool:
        """Whether the tier tells when it drops a chunk (an engine-local tier evicts
        by its own policy; a shared server evicts silently)."""
        return self.locality is Locality.LOCAL
