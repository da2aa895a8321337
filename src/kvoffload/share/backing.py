"""Where a share keeps its slots: what the node process needs to know of them (a
:class:`Backing`).

Every share runs the same node process, directory, sessions, fencing and index
(:mod:`.server`); only its slots differ. Two backings exist:

- :class:`~.memory_backing.MemoryBacking` (the default): shared-memory slab files
  in the share's own directory (:mod:`.slab_files`), made anew when their geometry
  changes; their bytes are never trusted, so its node process starts empty;
- :class:`~kvoffload.tiers.disk_backing.DiskBacking`: a lower tier's slab files,
  which outlive the node and whose every slot carries its own header and checksum,
  so its node process restores what the files hold once its generation fence is
  open (:attr:`Backing.restores`, :meth:`Backing.recover`).

A share's runtime files (socket, meta, locks, index, log) live under the share root
whatever its backing. The share code names no backing but the default: each one is a
module that implements :class:`Backing` and, for its node process's command line,
:class:`BackingOptions`, and runs :func:`kvoffload.share.serve.node_process_main` as
``python -m`` that module.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvoffload.core.keys import ChunkKey
from kvoffload.share.meta import ShareGeometry
from kvoffload.share.paths import DEFAULT_ROOT, SharePaths


@dataclass(frozen=True)
class Recovered:
    """What a backed share's node process restored: chunks adopted, copies ignored."""

    adopted: int
    ignored: int


class Backing(Protocol):
    """Where a backed share keeps its slots (see the module docstring)."""

    @property
    def tier(self) -> str:
        """The tier label of the share's directory."""

    @property
    def config_key(self) -> str:
        """The configuration key that errors about this share name."""

    @property
    def namespace(self) -> bytes:
        """The namespace label of the chunks it restores (``reset`` scopes by it)."""

    @property
    def module(self) -> str:
        """The module whose ``python -m`` runs this share's node process."""

    @property
    def restores(self) -> bool:
        """Whether the node process restores what the slots hold when it starts
        (:meth:`recover`, once its generation fence is open), or starts empty."""

    def share_name(self) -> str:
        """The share's name, derived from where the slots live."""

    def paths(self, share_root: Path = DEFAULT_ROOT, group: int | None = None) -> SharePaths:
        """The share's runtime files under ``share_root`` (trusted to ``group`` too)."""

    def arguments(self) -> list[str]:
        """The node process's command-line options naming this backing."""

    def hold(self, share: str) -> Callable[[], None]:
        """Take the files for node process ``share`` alone (its whole life), or raise
        :class:`~kvoffload.core.errors.ConfigError`; returns what releases them."""

    def prepare(self, paths: SharePaths, geometry: ShareGeometry) -> bytes:
        """Create (or resize) the slots for ``geometry`` (the share's runtime files are
        ``paths``), keeping what they hold where the backing keeps anything, and
        return the slab id they carry (``geometry.slab_id`` when kept; a new one when
        made anew). Not enough space: :class:`~kvoffload.core.errors.ConfigError`."""

    def owned_files(self, paths: SharePaths, geometry: ShareGeometry) -> list[Path]:
        """The slot files under ``paths`` the node process checks are still its own
        (removed or replaced: it stops serving)."""

    def recover(self, geometry: ShareGeometry) -> tuple[Sequence[tuple[ChunkKey, int]], Recovered]:
        """The complete chunks the files hold, ``(key, slot)`` oldest first, and the
        counts (what :meth:`~kvoffload.core.directory.Directory.restore` takes)."""


class BackingOptions(Protocol):
    """A backing's options on its node process's command line."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def from_arguments(self, args: argparse.Namespace) -> Backing:
        """The backing the parsed ``args`` name (:class:`UsageError` when they name
        none)."""
