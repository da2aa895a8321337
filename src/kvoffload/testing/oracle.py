"""Reference bytes of any chunk of any request of a reference engine.

A chunk key names a prefix, and the reference model's KV is a pure function of the
prefix's tokens, so the bytes a store must capture (and a load must bring back) are
known exactly. The key must belong to the request's *own* key chain (derived with
its own cache salt, in any key epoch the scheduler half has used: a job planned
before a connector reset names keys of the epoch before): a load of another tenant's
chunk is a violation even though the bytes would be equal.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvoffload.core.jobs import EngineJob
from kvoffload.core.keys import ChunkKey, KeyChain, Namespace
from kvoffload.engine.engine import ReferenceEngine
from kvoffload.engine.manual_worker import InvariantViolation
from kvoffload.engine.model import KV_BYTES, kv_chain


class Oracle:
    def __init__(
        self,
        engine: ReferenceEngine,
        namespace: Namespace,
        blocks_per_chunk: int,
        epochs: Sequence[bytes] = (b"",),
    ):
        self.engine = engine
        self.epochs = epochs  # every key epoch so far (the caller appends at resets)
        self.namespace = namespace
        self.blocks_per_chunk = blocks_per_chunk
        self.chunk_tokens = blocks_per_chunk * engine.config.block_size
        self._keys: dict[str, dict[ChunkKey, int]] = {}
        self._kv: dict[str, bytes] = {}

    def expected(self, job: EngineJob, chunk: int) -> bytes:
        req = self.engine.requests[job.request_id]
        index = self._index_of(job.request_id, job.keys[chunk])
        end = (index + 1) * self.chunk_tokens
        kv = self._kv.get(job.request_id, b"")
        if len(kv) < end * KV_BYTES:
            kv = kv_chain(req.tokens)
            self._kv[job.request_id] = kv
        return kv[index * self.chunk_tokens * KV_BYTES : end * KV_BYTES]

    def _index_of(self, request_id: str, key: ChunkKey) -> int:
        known = self._keys.get(request_id, {})
        if key not in known:
            req = self.engine.requests[request_id]
            known = {}
            for epoch in self.epochs:
                chain = KeyChain(self.namespace, self.blocks_per_chunk, epoch)
                known.update((k, i) for i, k in enumerate(chain.extend(req.block_hashes)))
            self._keys[request_id] = known
        if key not in known:
            raise InvariantViolation(
                f"a job of {request_id!r} names a chunk outside its own key chain"
            )
        return known[key]
