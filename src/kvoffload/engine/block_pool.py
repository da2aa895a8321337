"""The engine's paged KV memory: blocks, reference counts, a prefix cache, LRU reuse.

Each block holds ``block_size`` tokens of KV bytes in one bytearray. A block with a
hash is *cached*: a later request with the same block hash can share it
(``acquire``). Free blocks wait in an LRU queue; allocating takes the oldest free
block and evicts its hash (its content is about to be overwritten: the block is
*fresh*). Released blocks are queued tail-first so a prefix's last blocks are
reused first. Owned by one engine.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvoffload.engine.model import KV_BYTES

WriteHook = Callable[[Sequence[int]], None]


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.block_bytes = block_size * KV_BYTES
        self.data = bytearray(num_blocks * self.block_bytes)
        self.ref = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.on_write: WriteHook | None = None
        self.caching = True  # False: no block is ever shared through the prefix cache

    @property
    def num_free(self) -> int:
        return len(self.free)

    def cached_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """Blocks holding the longest cached prefix of ``hashes``."""
        out = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def acquire(self, blocks: Sequence[int]) -> None:
        for block in blocks:
            if self.ref[block] == 0:
                del self.free[block]
            self.ref[block] += 1

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh blocks (their cached content is evicted), or None if too few."""
        free = self.free
        if n > len(free):
            return None
        out = []
        hash_of, cached, ref, take = self.hash_of, self.cached, self.ref, free.popitem
        for _ in range(n):
            block, _ = take(last=False)
            stale = hash_of[block]
            if stale is not None:
                del cached[stale]
                hash_of[block] = None
            ref[block] = 1
            out.append(block)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        ref, free = self.ref, self.free
        for block in reversed(blocks):
            left = ref[block] - 1
            ref[block] = left
            if left == 0:
                free[block] = None

    def cache(self, blocks: Sequence[int], hashes: Sequence[bytes]) -> None:
        """Register full blocks under their hashes (first writer wins)."""
        if not self.caching:
            return
        hash_of, cached = self.hash_of, self.cached
        for block, h in zip(blocks, hashes, strict=False):
            if hash_of[block] is None and h not in cached:
                hash_of[block] = h
                cached[h] = block

    def read(self, block: int) -> bytes:
        start = block * self.block_bytes
        return bytes(self.data[start : start + self.block_bytes])

    def write(self, block: int, offset_tokens: int, data: bytes) -> None:
        if self.on_write is not None:
            self.on_write((block,))
        start = block * self.block_bytes + offset_tokens * KV_BYTES
        self.data[start : start + len(data)] = data

    def read_tokens(self, blocks: Sequence[int], n_tokens: int) -> bytes:
        """KV bytes of the first ``n_tokens`` positions held by ``blocks``."""
        out = bytearray()
        for i in range(0, n_tokens, self.block_size):
            block = blocks[i // self.block_size]
            take = min(self.block_size, n_tokens - i)
            start = block * self.block_bytes
            out += self.data[start : start + take * KV_BYTES]
        return bytes(out)
