"""A request inside the reference engine (satisfies ``EngineRequest``)."""

from __future__ import annotations

import enum
from collections.abc import Sequence

from kvoffload.core.keys import block_hashes


class Status(enum.Enum):
    WAITING = "waiting"  # queued: new, preempted, or its load has landed
    WAITING_FOR_LOAD = "waiting_for_load"  # blocks allocated, a load in flight
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


class RequestTables:
    """One request's tables, one per group (null blocks, then blocks it holds), and
    how many leading blocks of each are registered in the prefix cache. Owned by the
    request, written by its :class:`~kvoffload.engine.group_tables.GroupTables` only."""

    __slots__ = ("registered", "tables")

    def __init__(self, tables: list[list[int]]) -> None:
        self.tables = tables
        self.registered = [0] * len(tables)


class Request:
    """Tokens and engine-side progress of one request. Mutated only by its engine.

    ``output`` holds applied tokens; ``pending`` tokens sampled by a forward pass
    whose output the engine has not applied yet (batch-queue stepping). Block hashes
    cover full blocks of applied tokens, salted by ``salt``.

    ``block_ids`` is the request's block table with one KV cache group; with several
    (:class:`~kvoffload.engine.group_tables.GroupTables`) ``groups`` holds every
    group's table and ``block_ids`` is the first group's (truthy while it holds blocks).
    """

    def __init__(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        block_size: int,
        salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = list(prompt)
        self.max_tokens = max_tokens
        self.block_size = block_size
        self.salt = salt
        self.output: list[int] = []
        self.pending: list[int] = []
        self.status = Status.WAITING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.groups: RequestTables | None = None  # several KV cache groups only
        self.whole_allocation_next = True  # the next schedule sends every block id
        self.generation = 0  # bumped at preemption: stale sampled tokens are dropped
        self.load: tuple[int, int] | None = None  # (local tokens, external tokens)
        self.load_ok: bool | None = None  # None while the load is in flight
        self.preemptions = 0
        self._hashes: list[bytes] = []

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def known_tokens(self) -> list[int]:
        """Applied and pending tokens: what the next forward pass computes over."""
        return self.prompt + self.output + self.pending

    @property
    def block_hashes(self) -> list[bytes]:
        full = self.num_tokens // self.block_size
        if len(self._hashes) < full:
            start = len(self._hashes) * self.block_size
            parent = self._hashes[-1] if self._hashes else None
            self._hashes += block_hashes(
                self.tokens[start : full * self.block_size], self.block_size, self.salt, parent
            )
        return self._hashes

    @property
    def done(self) -> bool:
        return self.status in (Status.FINISHED, Status.ABORTED)

    def wants_more(self) -> bool:
        return len(self.output) + len(self.pending) < self.max_tokens

    def target_tokens(self) -> int:
        """Positions whose KV the engine computes: all known tokens, except the
        final sampled one (nothing reads its KV)."""
        known = len(self.prompt) + len(self.output) + len(self.pending)
        return known if self.wants_more() else known - 1
