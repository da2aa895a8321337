"""The limits of a workload's hit rate: the infinite-cache bound and the offline
optimum (Belady's MIN with bypass) of a cache of N chunks, under prefix semantics.

What is computed, from the requests in arrival order (no engine, no timing):

- every request's prompt is cut into chunks of ``chunk_tokens``; a full chunk is
  identified by the chained hash of the content up to its end (the simulator's
  :class:`~kvoffload.simulate.content.Content` hashes, salt included), so a chunk
  id implies the ids of every chunk before it. A partial last chunk is never
  cached (as kvoffload stores full chunks only) but counts as a distinct chunk;
- a request hits chunks ``0..k-1`` where ``k`` is the longest run of leading chunks
  all in the cache (prefix semantics), and is served ``min(k * chunk_tokens, cap)``
  prompt tokens, ``cap`` being the prompt less one token, rounded down to the
  engine's block (the engine always computes at least the last prompt token, as
  vLLM does); then all the full chunks it computed become cache candidates at once:
  its prompt's and those its output completes (all its tokens but the last, whose KV
  is never computed), so a next turn that resends an answer can hit it;
- **infinite**: a cache that keeps every chunk ever seen;
- **optimum** at ``capacity`` chunks: after each request the cache keeps, of the
  chunks it held and the request's, the ``capacity`` whose next use (the next
  request containing them) is soonest, dropping chunks never used again and, on a
  tie, the later chunk of a prompt first. That is Belady's MIN with bypass: a new
  chunk whose next use is farther than every kept one is not admitted.

Why the optimum is an upper bound (in chunk hits): a request that contains a chunk
contains every chunk before it, so a chunk's next use is never sooner than its
predecessor's; with the tie rule the cache therefore never holds a chunk without its
predecessor, and every cached chunk a request contains is in its hit prefix. Its
prefix hits then equal its plain hits on the stream of chunk references, which MIN
maximizes over all caches of ``capacity`` chunks, and no cache's prefix hits exceed
its plain hits. Two caveats keep it a bound of this model, not a theorem about the
simulator: in tokens the ``cap`` trims a fully cached prompt's last chunk, which MIN
does not weigh (it maximizes chunk hits); and the bound is for one cache of
``capacity`` whole chunks and instant insertion, whereas the simulated engine has its
own prefix cache besides kvoffload's host memory, which hits partial chunks block by
block (so where the engine serves most hits, as in chats that resend their history,
a run may exceed it), but sees a request's chunks only once computed (so concurrent
requests miss what the bound hits). (The exhaustive search in the tests confirms
the optimality on small random workloads, outputs' chunks included.)

Cost: one pass to hash (seconds for 10^5 requests), then O(references x log) per
capacity.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field

from kvoffload.simulate.content import ContentHasher
from kvoffload.simulate.trace import TraceRequest

_NEVER = 1 << 62


@dataclass
class References:
    """The chunk references of a workload (see the module docstring).

    ``chunks[i]``: request ``i``'s full prompt chunks as small ints (equal int, equal
    content and prefix); ``outputs[i]``: the full chunks after those that its output
    completes; ``prompts[i]``: its prompt tokens; ``distinct``: distinct prompt
    chunks, full and partial."""

    chunk_tokens: int
    block_size: int
    chunks: list[list[int]] = field(default_factory=list)
    prompts: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)
    distinct: int = 0

    def __post_init__(self) -> None:
        if not self.outputs:
            self.outputs = [[] for _ in self.chunks]

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompts)


def chunk_references(
    requests: Iterable[TraceRequest], chunk_tokens: int, block_size: int
) -> References:
    """Hash ``requests`` (in arrival order) into chunk references; ``block_size``:
    the engine's, for the last-token cap."""
    hasher = ContentHasher(chunk_tokens)
    refs = References(chunk_tokens, block_size)
    ids: dict[bytes, int] = {}
    prompt_chunks: set[int] = set()
    tails: set[bytes] = set()
    for index, req in enumerate(requests):
        content = hasher.content(req, index)
        prompt = req.prompt_tokens
        full = prompt // chunk_tokens
        computed = (prompt + req.output - 1) // chunk_tokens
        hashes = content.hashes(0, computed, chunk_tokens, None)
        row = [ids.setdefault(h, len(ids)) for h in hashes]
        refs.chunks.append(row[:full])
        refs.outputs.append(row[full:])
        refs.prompts.append(prompt)
        prompt_chunks.update(row[:full])
        if prompt % chunk_tokens:
            parent = hashes[full - 1] if full else None
            tails.add(content.span_hash(full * chunk_tokens, prompt, parent))
    refs.distinct = len(prompt_chunks) + len(tails)
    return refs


def _cap(prompt: int, block_size: int) -> int:
    """The most prompt tokens a hit may cover: all but the last, whole blocks."""
    return (prompt - 1) // block_size * block_size


def _next_uses(refs: References) -> list[list[int]]:
    """For each chunk a request computed (its prompt's, then its output's), the index
    of the next request whose prompt contains it (``_NEVER``: none)."""
    last: dict[int, int] = {}
    out: list[list[int]] = [[] for _ in refs.chunks]
    for i in range(len(refs.chunks) - 1, -1, -1):
        row = refs.chunks[i]
        out[i] = [last.get(c, _NEVER) for c in (*row, *refs.outputs[i])]
        for c in row:
            last[c] = i
    return out


def infinite_hit_tokens(refs: References) -> int:
    """Prompt tokens served with a cache that keeps every chunk."""
    seen: set[int] = set()
    total = 0
    size, block = refs.chunk_tokens, refs.block_size
    for row, prompt, output in zip(refs.chunks, refs.prompts, refs.outputs, strict=True):
        k = 0
        for c in row:
            if c not in seen:
                break
            k += 1
        total += min(k * size, _cap(prompt, block))
        seen.update(row)
        seen.update(output)
    return total


def optimum_hit_tokens(refs: References, capacity: int) -> int:
    """Prompt tokens served by Belady's MIN with bypass at ``capacity`` chunks."""
    if capacity <= 0:
        return 0
    size, block = refs.chunk_tokens, refs.block_size
    cache: dict[int, int] = {}  # chunk -> its next use
    heap: list[tuple[int, int, int]] = []  # (-next use, -position, chunk); stale allowed
    total = 0
    uses = _next_uses(refs)
    for i, row in enumerate(refs.chunks):
        k = 0
        for c in row:
            if c not in cache:
                break
            k += 1
        total += min(k * size, _cap(refs.prompts[i], block))
        computed = (*row, *refs.outputs[i])
        for position, (c, nxt) in enumerate(zip(computed, uses[i], strict=True)):
            if nxt == _NEVER:
                cache.pop(c, None)
                continue
            cache[c] = nxt
            heapq.heappush(heap, (-nxt, -position, c))
        while len(cache) > capacity:
            neg, _, c = heapq.heappop(heap)
            if cache.get(c) == -neg:
                del cache[c]
    return total


@dataclass(frozen=True)
class Bounds:
    """The limits of one run: hit tokens of the optimum at ``capacity_chunks`` and
    of an infinite cache, over ``prompt_tokens``."""

    capacity_chunks: int
    optimum_tokens: int
    infinite_tokens: int
    prompt_tokens: int

    @property
    def optimum_rate(self) -> float:
        return self.optimum_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def infinite_rate(self) -> float:
        return self.infinite_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def bounds(refs: References, capacity: int, infinite: int | None = None) -> Bounds:
    """The bounds at ``capacity`` chunks (``infinite``: the infinite-cache tokens if
    already computed)."""
    inf = infinite_hit_tokens(refs) if infinite is None else infinite
    return Bounds(capacity, optimum_hit_tokens(refs, capacity), inf, refs.prompt_tokens)
