"""What a simulated request's tokens are, as salted chained block hashes.

The simulator never materializes token ids for the segment form: a request's
content is a list of *pieces* (a named segment, a run of literal token ids, or its
own anonymous output) and each full block of ``block_size`` positions is hashed
from the parts of the pieces it covers, chained from the previous block's hash and
seeded by the cache salt. So two requests get the same hash for block ``j`` exactly
when their content up to the end of block ``j`` is the same pieces (same ids at the
same offsets, or the same token ids) under the same salt — the engine's prefix-cache
semantics, at a cost per block independent of its tokens.

:class:`ContentHasher` (one per simulation) memoizes the hash chains of finished
requests by their piece list, so a request that extends an earlier one (the next
turn of a chat) hashes only its new blocks. Deterministic across processes.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Hashable
from functools import lru_cache

from kvoffload.core.keys import tokens_bytes
from kvoffload.simulate.trace import TraceRequest

_SEED = b"kvoffload/simulate/content/v1"
_MEMO_TRIES = 4  # longest piece-list prefixes tried in the memo


def _blake(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def _lp(data: bytes) -> bytes:
    return len(data).to_bytes(4, "little") + data


@lru_cache(maxsize=1024)
def _seed(salt: str | None) -> bytes:
    """The hash 'before' block 0 of content under ``salt``."""
    return _blake(_SEED + (b"\x00" if salt is None else b"\x01" + _lp(salt.encode())))


class Content:
    """The pieces of one request (its prompt, then its output) and their offsets.

    Immutable after construction. ``memo_key`` is None when the content has literal
    token pieces (never memoized)."""

    __slots__ = ("ends", "memo_key", "prompt_pieces", "salt", "seed", "starts", "tags", "tokens")

    def __init__(self, req: TraceRequest, index: int, tags: dict[str, bytes]) -> None:
        """``tags``: a cache of segment-id encodings shared by a simulation's requests."""
        piece_tags: list[bytes] = []
        ends: list[int] = []
        tokens: list[tuple[int, ...] | None] = []
        end = 0
        if req.prompt:
            piece_tags.append(b"T")
            end += len(req.prompt)
            ends.append(end)
            tokens.append(req.prompt)
        named = [sid for sid, _ in req.segments]
        if req.output_id is not None:
            named.append(req.output_id)
        for sid, n in req.segments:
            tag = tags.get(sid)
            if tag is None:
                tag = tags[sid] = b"S" + _lp(sid.encode())
            piece_tags.append(tag)
            end += n
            ends.append(end)
            tokens.append(None)
        keys: list[Hashable] = list(named)
        if req.output_id is not None:
            tag = tags.get(req.output_id)
            if tag is None:
                tag = tags[req.output_id] = b"S" + _lp(req.output_id.encode())
            piece_tags.append(tag)
        else:
            piece_tags.append(b"O" + index.to_bytes(8, "little"))
            keys.append(index)  # an int: never equal to a segment id
        ends.append(end + req.output)
        tokens.append(None)
        self.tags = piece_tags
        self.tokens = tokens
        self.ends = ends
        self.starts = [0, *ends[:-1]]
        self.prompt_pieces = len(ends) - 1
        self.salt = req.salt
        self.seed = _seed(req.salt)
        self.memo_key: tuple[Hashable, ...] | None = None if req.prompt else tuple(keys)

    def _part(self, piece: int, start: int, end: int) -> bytes:
        """Encoding of positions ``start:end`` (relative) of piece ``piece``."""
        run = self.tokens[piece]
        if run is not None:
            return b"T" + _lp(tokens_bytes(run[start:end]))
        return self.tags[piece] + start.to_bytes(4, "little") + end.to_bytes(4, "little")

    def hashes(self, first: int, end: int, block_size: int, parent: bytes | None) -> list[bytes]:
        """Hashes of blocks ``first .. end - 1`` (each fully inside the content),
        chained from ``parent``, the hash of block ``first - 1`` (None for block 0)."""
        out: list[bytes] = []
        prev = self.seed if parent is None else parent
        starts, ends = self.starts, self.ends
        piece = bisect_right(ends, first * block_size)
        for block in range(first, end):
            lo, hi = block * block_size, (block + 1) * block_size
            if ends[piece] >= hi:  # the common case: one piece covers the block
                desc = self._part(piece, lo - starts[piece], hi - starts[piece])
            else:
                desc = self._span(lo, hi, piece)
            prev = _blake(prev + desc)
            out.append(prev)
            if ends[piece] == hi:
                piece += 1
        return out

    def _span(self, lo: int, hi: int, piece: int) -> bytes:
        """Encoding of positions ``lo:hi`` (absolute), from piece ``piece`` on."""
        starts, ends = self.starts, self.ends
        parts = []
        pos = lo
        while pos < hi:
            while ends[piece] <= pos:
                piece += 1
            stop = min(hi, ends[piece])
            parts.append(self._part(piece, pos - starts[piece], stop - starts[piece]))
            pos = stop
        return b"".join(parts)

    def span_hash(self, lo: int, hi: int, parent: bytes | None) -> bytes:
        """The hash of positions ``lo:hi`` chained from ``parent`` (the hash of the
        content before ``lo``; None: ``lo`` is 0), as :meth:`hashes` hashes a block:
        for a partial last block, equal exactly when the content up to ``hi`` is."""
        prev = self.seed if parent is None else parent
        return _blake(prev + self._span(lo, hi, bisect_right(self.ends, lo)))


class ContentHasher:
    """Block hashing with a bounded memo of finished requests' hash chains."""

    def __init__(self, block_size: int, max_entries: int = 65536) -> None:
        self.block_size = block_size
        self.max_entries = max_entries
        self._memo: OrderedDict[tuple[str | None, tuple[Hashable, ...]], tuple[bytes, ...]] = (
            OrderedDict()
        )
        self.memo_hits = 0
        self.tags: dict[str, bytes] = {}

    def content(self, req: TraceRequest, index: int) -> Content:
        """The content of ``req``, the ``index``-th request of the workload."""
        return Content(req, index, self.tags)

    def initial(self, content: Content) -> list[bytes]:
        """Block hashes known for ``content`` from an earlier request whose whole
        content is a prefix of it (possibly none)."""
        key = content.memo_key
        if key is None:
            return []
        n = len(key)
        for k in range(n, max(0, n - _MEMO_TRIES), -1):
            found = self._memo.get((content.salt, key[:k]))
            if found is not None:
                self.memo_hits += 1
                return list(found)
        return []

    def extend(self, content: Content, hashes: list[bytes], full: int) -> None:
        """Append hashes to ``hashes`` until it covers ``full`` blocks."""
        have = len(hashes)
        if have < full:
            parent = hashes[-1] if hashes else None
            hashes += content.hashes(have, full, self.block_size, parent)

    def remember(self, content: Content, hashes: list[bytes]) -> None:
        """``hashes`` cover every full block of ``content`` (its request finished)."""
        key = content.memo_key
        if key is None or len(hashes) != content.ends[-1] // self.block_size:
            return
        memo_key = (content.salt, key)
        self._memo[memo_key] = tuple(hashes)
        self._memo.move_to_end(memo_key)
        while len(self._memo) > self.max_entries:
            self._memo.popitem(last=False)
