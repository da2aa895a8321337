"""KV cache groups: which layers a chunk holds and what a hit needs of each group.

A hybrid model's engine keeps its layers' KV in several *groups* (vLLM's hybrid KV
cache manager): full-attention layers keep a block for every token of a request,
sliding-window layers only the blocks their window still reads (the engine frees
the others mid-request and puts its null block in their place). Every group uses the
same block size and one shared block pool; a block belongs to one group at a time.

kvoffload stores one chunk per (group, chunk of tokens): chunk ``c`` of group ``g``
holds the KV of tokens ``[c * chunk_tokens, (c + 1) * chunk_tokens)`` of that group's
layers, under :meth:`KVGroups.key` (the request's chain key for ``c``, made distinct
per group; with a single group it *is* the chain key, so one-group layouts keep
their keys). All groups' chunks have the same size (the engine gives every group
the same number of layers, checked at start).

What a hit of ``T`` tokens needs: a full-attention group every chunk below ``T``; a
window group only the chunks its window reads when computing token ``T`` onwards,
from :meth:`KVGroups.first_needed_chunk`. A window group's block is *dead* once the
engine may have freed it: blocks below :meth:`KVGroups.first_live_block` of the
tokens the engine counted as computed when it last scheduled the request. Dead
blocks are never stored from; load blocks below the window are the engine's null
block and are never written.

Immutable; pure functions of their arguments.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvoffload.core.errors import ConfigError
from kvoffload.core.keys import ChunkKey


@dataclass(frozen=True)
class KVGroup:
    """One KV cache group. ``window``: the tokens a new token attends to, itself
    included (a sliding window, plus tokens the engine retains past it); None for
    full attention."""

    window: int | None = None

    def __post_init__(self) -> None:
        if self.window is not None and (isinstance(self.window, bool) or self.window < 1):
            raise ConfigError(
                "kv_groups", f"a window must be a positive token count, got {self.window!r}"
            )

    @property
    def full(self) -> bool:
        return self.window is None

    def skipped_tokens(self, computed_tokens: int) -> int:
        """Leading tokens the group no longer reads once ``computed_tokens`` tokens
        are computed (the engine's rule; 0 for full attention)."""
        if self.window is None:
            return 0
        return max(0, computed_tokens - self.window + 1)


@dataclass(frozen=True)
class KVGroups:
    """The engine's KV cache groups, in the engine's group order (see the module
    docstring). The default is one full-attention group."""

    groups: tuple[KVGroup, ...] = (KVGroup(),)
    # Derived from ``groups`` once (read on every step's hot paths).
    single: bool = field(init=False, compare=False, repr=False)
    """One group: its chunk keys are the chain keys."""
    windowed: bool = field(init=False, compare=False, repr=False)
    """Some group frees blocks mid-request (a sliding window)."""
    plain: bool = field(init=False, compare=False, repr=False)
    """One full-attention group: chunk ``c`` is chain key ``c`` and its blocks."""

    def __post_init__(self) -> None:
        if not self.groups:
            raise ConfigError("kv_groups", "needs at least one KV cache group")
        single = len(self.groups) == 1
        windowed = any(not g.full for g in self.groups)
        object.__setattr__(self, "single", single)
        object.__setattr__(self, "windowed", windowed)
        object.__setattr__(self, "plain", single and not windowed)

    def __len__(self) -> int:
        return len(self.groups)

    def key(self, key: ChunkKey, group: int) -> ChunkKey:
        """The key of chain key ``key``'s chunk in ``group``."""
        if self.single:
            return key
        tag = b"kvoffload/group\x00" + group.to_bytes(4, "big")
        return ChunkKey(hashlib.blake2b(tag + key, digest_size=len(key)).digest())

    def all_keys(self, keys: Sequence[ChunkKey]) -> list[ChunkKey]:
        """Every group's key of each chain key in ``keys``, chunk after chunk (the
        directory's keys of those chunks; ``keys`` itself with one group)."""
        if self.single:
            return list(keys)
        return [self.key(k, g) for k in keys for g in range(len(self.groups))]

    def first_needed_chunk(self, group: int, hit_tokens: int, chunk_tokens: int) -> int:
        """The first chunk ``group`` needs to continue after ``hit_tokens`` tokens."""
        return self.groups[group].skipped_tokens(hit_tokens) // chunk_tokens

    def first_live_block(self, group: int, computed_tokens: int, block_size: int) -> int:
        """Blocks of ``group`` below this index may have been freed by the engine once
        it counted ``computed_tokens`` tokens computed."""
        return self.groups[group].skipped_tokens(computed_tokens) // block_size

    def describe(self) -> str:
        """``full`` or ``window=64``, per group (for logs and namespaces)."""
        return ",".join("full" if g.full else f"window={g.window}" for g in self.groups)


ONE_GROUP = KVGroups()
