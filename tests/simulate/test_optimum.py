"""The workload's limits: Belady's MIN with bypass under prefix semantics, checked by
hand on small sequences and against an exhaustive search; the infinite cache; chunk
references hashed from requests."""

from __future__ import annotations

import random
from functools import cache
from itertools import combinations

import pytest

from kvoffload.simulate.optimum import (
    References,
    bounds,
    chunk_references,
    infinite_hit_tokens,
    optimum_hit_tokens,
)
from kvoffload.simulate.trace import TraceRequest

C = 10  # tokens per chunk


def refs(
    *rows: list[int], block: int = 1, tail: int = 5, outputs: list[list[int]] | None = None
) -> References:
    """Requests of the given full chunks, each with a partial tail of ``tail`` tokens;
    ``outputs``: the chunks each one's output completes (default none)."""
    prompts = [C * len(row) + tail for row in rows]
    return References(C, block, [list(row) for row in rows], prompts, outputs or [])


def test_by_hand_the_farthest_next_use_is_bypassed() -> None:
    r = refs([1, 2], [3], [1, 2], [3], [1])
    # capacity 2: chunk 3 (next use request 3) is farther than 1 and 2 (request 2):
    # bypassed; then 2 is never used again and dropped, 1 is kept for request 4.
    assert optimum_hit_tokens(r, 2) == 2 * C + C
    assert infinite_hit_tokens(r) == 2 * C + C + C
    assert optimum_hit_tokens(r, 3) == infinite_hit_tokens(r)
    assert optimum_hit_tokens(r, 0) == 0


def test_on_a_tie_the_later_chunk_of_a_prompt_goes_first() -> None:
    # 1 and 2 are both next used by request 1; keeping 2 without 1 would hit nothing.
    assert optimum_hit_tokens(refs([1, 2], [1, 2]), 1) == C


def test_a_fully_cached_prompt_still_computes_its_last_token() -> None:
    r = refs([1, 2], [1, 2], tail=0)  # 20-token prompts, both chunks cached the second time
    assert infinite_hit_tokens(r) == 2 * C - 1
    r.block_size = 4  # whole engine blocks: 19 tokens round down to 16
    assert infinite_hit_tokens(r) == 16
    assert optimum_hit_tokens(r, 5) == 16


def brute_force(r: References, capacity: int) -> int:
    """The most prompt tokens any cache of ``capacity`` chunks serves (prefix
    semantics): every choice of what to keep after every request."""

    @cache
    def best(i: int, held: frozenset[int]) -> int:
        if i == len(r.chunks):
            return 0
        row = r.chunks[i]
        k = 0
        while k < len(row) and row[k] in held:
            k += 1
        pool = sorted(held | set(row) | set(r.outputs[i]))
        keep = min(capacity, len(pool))
        return C * k + max(best(i + 1, frozenset(kept)) for kept in combinations(pool, keep))

    return best(0, frozenset())


def random_refs(seed: int, requests: int) -> References:
    """Prompts that walk a small binary trie (a chunk's id is its path), so a chunk
    always follows the same predecessor, as hashed chunks do."""
    rng = random.Random(seed)
    ids: dict[tuple[int, ...], int] = {}
    rows, outputs = [], []
    for _ in range(requests):
        path = tuple(rng.randrange(2) for _ in range(rng.randint(1, 3)))
        rows.append([ids.setdefault(path[: j + 1], len(ids)) for j in range(len(path))])
        # a third of the outputs complete one more chunk (the next turn's, say)
        answer = path + (rng.randrange(2),)
        outputs.append([ids.setdefault(answer, len(ids))] if rng.random() < 1 / 3 else [])
    return refs(*rows, outputs=outputs)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("capacity", [1, 2, 3])
def test_the_optimum_matches_an_exhaustive_search(seed: int, capacity: int) -> None:
    r = random_refs(seed, 8)
    assert optimum_hit_tokens(r, capacity) == brute_force(r, capacity)


def test_more_capacity_never_serves_less() -> None:
    r = random_refs(99, 300)
    served = [optimum_hit_tokens(r, n) for n in range(0, 16)]
    assert served == sorted(served) and served[-1] == infinite_hit_tokens(r)
    b = bounds(r, 4)
    assert b.optimum_tokens == served[4] and b.infinite_tokens == served[-1]
    assert 0 < b.optimum_rate < b.infinite_rate <= 1


def seg(
    t: float, *segments: tuple[str, int], salt: str | None = None, answer: str | None = None
) -> TraceRequest:
    output = 8 if answer else 4
    return TraceRequest(t, output, segments=segments, output_id=answer, salt=salt, where="test")


def test_chunk_references_follow_content_and_salt() -> None:
    requests = [
        seg(0, ("sys", 20), ("a", 15)),  # chunks: sys[0:10], sys[10:20], a[0:10]; tail 5
        seg(1, ("sys", 20), ("b", 15)),  # shares two chunks; b's chunk differs
        seg(2, ("sys", 20), ("a", 15), salt="x"),  # another salt: nothing shared
        seg(3, ("sys", 20), ("a", 15)),  # the first request again
    ]
    r = chunk_references(requests, C, 1)
    first, second, salted, again = r.chunks
    assert second[:2] == first[:2] and second[2] != first[2]
    assert not set(salted) & set(first)
    assert again == first
    assert r.prompts == [35] * 4 and r.prompt_tokens == 140
    assert r.distinct == 3 + 1 + 3 + 3  # full chunks 3 + 1 + 3, and three distinct tails
    assert infinite_hit_tokens(r) == 20 + 30


def test_a_chunk_an_output_completes_is_a_candidate() -> None:
    first = seg(0, ("q1", 15), answer="a1")  # computes 15 + 8 - 1 tokens: chunks 0 and 1
    second = seg(1, ("q1", 15), ("a1", 8), ("q2", 7))  # resends the answer
    r = chunk_references([first, second], C, 1)
    assert r.chunks[0] == [0] and r.outputs[0] == [1]
    assert r.chunks[1][:2] == [0, 1] and r.outputs[1] == []
    assert r.distinct == 3 + 1  # prompt chunks 0, 1, 2 and the first request's tail
    assert infinite_hit_tokens(r) == optimum_hit_tokens(r, 2) == 2 * C
    assert optimum_hit_tokens(r, 1) == C
