"""The deterministic model over several KV cache groups, checking what it reads.

For an engine whose batcher uses :class:`~kvoffload.engine.group_tables.GroupTables`.
Group ``g``'s KV of position ``i`` is :func:`group_kv` of the reference KV
(:mod:`kvoffload.engine.model`), so the groups' blocks differ and a chunk loaded into
another group's blocks, or another position's, is wrong. A forward pass computing
positions ``[start, end)``:

1. checks every position each group reads, byte for byte: a full group every
   position below ``start``, a window group those its window still reads
   (:meth:`~kvoffload.core.kv_groups.KVGroup.skipped_tokens`); a mismatch (a wrong
   load, an overwritten block) raises :class:`~kvoffload.engine.manual_worker.InvariantViolation`;
2. writes every group's KV of ``[start, end)`` into that group's blocks;
3. samples as the reference model does (:func:`~kvoffload.engine.model.reference_outputs`
   is the oracle: what it read was checked).

Applying the output is the deterministic model's.
"""

from __future__ import annotations

import hashlib

from kvoffload.core.scheduler_types import ScheduledRequest
from kvoffload.engine.block_pool import BlockPool
from kvoffload.engine.group_tables import GroupTables
from kvoffload.engine.manual_worker import InvariantViolation
from kvoffload.engine.model import KV_BYTES, kv_chain, sample
from kvoffload.engine.request import Request
from kvoffload.engine.strategies import DeterministicModel, Sampled


def group_kv(kv: bytes, group: int) -> bytes:
    """Group ``group``'s KV bytes of a position whose reference KV is ``kv``."""
    return hashlib.blake2b(kv + bytes((group,)), digest_size=KV_BYTES).digest()


class GroupModel(DeterministicModel):
    """See the module docstring. Reads and writes ``pool`` through the requests'
    group tables; ``checked`` counts the positions verified."""

    def __init__(self, pool: BlockPool, tables: GroupTables, vocab: int) -> None:
        super().__init__(pool, pool.block_size, vocab)
        self.tables = tables
        self.checked = 0

    def forward(self, req: Request, sched: ScheduledRequest, sampled: list[Sampled]) -> None:
        rt = req.groups
        if rt is None:
            raise InvariantViolation(f"{req.request_id!r} computed without block tables")
        bs, tokens = self.block_size, req.known_tokens
        start = sched.num_computed_tokens
        end = start + sched.num_scheduled_tokens
        chain = kv_chain(tokens[:end])
        for g, (group, table) in enumerate(zip(self.tables.groups, rt.tables, strict=True)):
            for pos in range(group.skipped_tokens(start), start):
                self._check(req, g, table[pos // bs], pos, chain)
            for pos in range(start, end):
                kv = group_kv(chain[pos * KV_BYTES : (pos + 1) * KV_BYTES], g)
                self.pool.write(table[pos // bs], pos % bs, kv)
        if end == len(tokens) and req.wants_more():
            token = sample(chain, self.vocab)
            req.pending.append(token)
            sampled.append((req, req.generation, token))

    def _check(self, req: Request, group: int, block: int, pos: int, chain: bytes) -> None:
        want = group_kv(chain[pos * KV_BYTES : (pos + 1) * KV_BYTES], group)
        at = block * self.pool.block_bytes + (pos % self.block_size) * KV_BYTES
        if bytes(self.pool.data[at : at + KV_BYTES]) != want:
            raise InvariantViolation(
                f"{req.request_id!r}: group {group} block {block} holds wrong KV for position {pos}"
            )
        self.checked += 1
