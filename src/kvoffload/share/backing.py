"""A share whose slots live in files of their own instead of shared-memory slabs: what
the node process needs to know of them (a :class:`Backing`).

A backed share runs the same node process, directory, sessions, fencing and index as
a host share (:mod:`.server`); only its slots differ: files that outlive the node
(e.g. a lower tier's slab files, whose every slot carries its own header and
checksum), so its node process, unlike a host share's, does not start empty: once
its generation fence is open it restores what the files hold (:meth:`Backing.recover`).
Its runtime files (socket, meta, locks, index, log) stay under the share root.

The share code names no backing: each backing is a module of its own that implements
:class:`Backing` and, for its node process's command line, :class:`BackingOptions`,
and runs :func:`kvoffload.share.serve.node_process_main` as ``python -m`` that module.
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

    def share_name(self) -> str:
        """The share's name, derived from where the slots live."""

    def paths(self, share_root: Path = DEFAULT_ROOT, group: int | None = None) -> SharePaths:
        """The share's runtime files under ``share_root`` (trusted to ``group`` too)."""

    def arguments(self) -> list[str]:
        """The node process's command-line options naming this backing."""

    def hold(self, share: str) -> Callable[[], None]:
        """Take the files for node process ``share`` alone (its whole life), or raise
        :class:`~kvoffload.core.errors.ConfigError`; returns what releases them."""

    def prepare(self, geometry: ShareGeometry) -> None:
        """Create (or resize) the files for ``geometry``, keeping what they hold."""

    def recover(self, geometry: ShareGeometry) -> tuple[Sequence[tuple[ChunkKey, int]], Recovered]:
        """The complete chunks the files hold, ``(key, slot)`` oldest first, and the
        counts (what :meth:`~kvoffload.core.directory.Directory.restore` takes)."""


class BackingOptions(Protocol):
    """A backing's options on its node process's command line."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def from_arguments(self, args: argparse.Namespace) -> Backing | None:
        """The backing the parsed ``args`` name (None: none, a host share)."""
