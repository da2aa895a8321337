"""The reference engine's replaceable parts: a protocol each, the reference default.

- :class:`Model`: the forward pass (compute KV, sample) and applying what it sampled
  to the requests; default :class:`DeterministicModel` (:mod:`kvoffload.engine.model`).
- :class:`Holders`: which waiting requests hold blocks, as the batcher asks before
  preempting and admitting; default :class:`QueueScan` (scans the queue).
- :class:`Registration`: registering a request's computed blocks in the prefix
  cache; default :class:`RegisterFull`.

The engine and its batcher take these in their constructors; a replacement must
decide exactly as the default does (the simulator's are faster, not different), or
say in its own docstring what it changes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from kvoffload.core.scheduler_types import ScheduledRequest
from kvoffload.engine.block_pool import BlockPool
from kvoffload.engine.model import KV_BYTES, SEED, kv_next, sample
from kvoffload.engine.request import Request, Status

Sampled = tuple[Request, int, int]
"""What a forward pass sampled for a request: (request, its generation then, value);
the value is the model's (a token for the reference model)."""


class Model(Protocol):
    """The forward pass and its output, owned by one engine."""

    def forward(self, req: Request, sched: ScheduledRequest, sampled: list[Sampled]) -> None:
        """Compute the KV of ``sched``'s positions of ``req`` (its blocks are
        allocated); append what it samples to ``sampled``. Mutates ``req.pending``."""

    def apply(self, sampled: Sequence[Sampled], finish: Callable[[Request], None]) -> None:
        """Apply a batch's ``sampled`` output, in order, to requests still running in
        the generation it was sampled in; call ``finish`` for each request now done."""


class DeterministicModel:
    """The reference model (see :mod:`kvoffload.engine.model`): reads and writes the
    engine's block ``pool``; tokens depend on every KV byte of the context."""

    def __init__(self, pool: BlockPool, block_size: int, vocab: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.vocab = vocab

    def forward(self, req: Request, sched: ScheduledRequest, sampled: list[Sampled]) -> None:
        """Compute KV for the scheduled positions, reading the chain's previous link
        from the blocks; sample from every context position read from the blocks."""
        bs = self.block_size
        tokens = req.known_tokens
        start, end = (
            sched.num_computed_tokens,
            sched.num_computed_tokens + sched.num_scheduled_tokens,
        )
        prev = self.pool.read_tokens(req.block_ids, start)[-KV_BYTES:] if start else SEED
        pos = start
        while pos < end:
            block, offset = req.block_ids[pos // bs], pos % bs
            take = min(bs - offset, end - pos)
            chunk = bytearray()
            for token in tokens[pos : pos + take]:
                prev = kv_next(prev, token)
                chunk += prev
            self.pool.write(block, offset, bytes(chunk))
            pos += take
        if end == len(tokens) and req.wants_more():
            token = sample(self.pool.read_tokens(req.block_ids, end), self.vocab)
            req.pending.append(token)
            sampled.append((req, req.generation, token))

    def apply(self, sampled: Sequence[Sampled], finish: Callable[[Request], None]) -> None:
        """Each token moves from ``pending`` to ``output``; a request finishes when it
        has ``max_tokens`` of them."""
        for req, generation, token in sampled:
            if generation != req.generation or req.status is not Status.RUNNING:
                continue
            req.pending.pop(0)
            req.output.append(token)
            if len(req.output) >= req.max_tokens:
                finish(req)


class Holders(Protocol):
    """The waiting requests that hold blocks (allocated at an admission that issued a
    load), in queue order; owned by one batcher."""

    def admitted(self, req: Request) -> None:
        """``req`` was just admitted by a lookup (it may wait for a load now)."""

    def idle(self, waiting: Sequence[Request]) -> list[Request]:
        """Requests of ``waiting`` holding blocks whose load has been reported."""

    def loading(self, waiting: Sequence[Request]) -> bool:
        """Whether a request of ``waiting`` holds blocks for a load still in flight."""


class QueueScan:
    """The reference :class:`Holders`: scans the whole queue on every question."""

    def admitted(self, req: Request) -> None:
        """Nothing to remember: the queue is scanned."""

    def idle(self, waiting: Sequence[Request]) -> list[Request]:
        return [
            r
            for r in waiting
            if r.block_ids and (r.status is not Status.WAITING_FOR_LOAD or r.load_ok is not None)
        ]

    def loading(self, waiting: Sequence[Request]) -> bool:
        return any(r.status is Status.WAITING_FOR_LOAD and r.load_ok is None for r in waiting)


class Registration(Protocol):
    """Registers requests' computed blocks in the prefix cache of one block pool."""

    def register(self, req: Request) -> None:
        """Register ``req``'s full computed blocks (none while it waits for a load or
        once it is done). Mutates the pool's prefix cache only."""


class RegisterFull:
    """The reference :class:`Registration`: offers every full computed block to
    ``pool`` (which keeps the first block registered under a hash)."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size

    def register(self, req: Request) -> None:
        if req.status is Status.WAITING_FOR_LOAD or req.done:
            return
        full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes))
        self.pool.cache(req.block_ids[:full], req.block_hashes[:full])
