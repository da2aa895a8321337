"""Prefix-sharing semantics: segments with the same id share content, salts isolate."""

from __future__ import annotations

from sim_helpers import seg, simulate

from kvoffload.simulate.content import ContentHasher
from kvoffload.simulate.trace import TraceRequest

BLOCK = 16


def hashes(req: TraceRequest, index: int = 0, hasher: ContentHasher | None = None) -> list[bytes]:
    hasher = hasher or ContentHasher(BLOCK)
    content = hasher.content(req, index)
    out = hasher.initial(content)[: req.prompt_tokens // BLOCK]
    hasher.extend(content, out, req.prompt_tokens // BLOCK)
    return out


def test_blocks_match_exactly_as_far_as_the_segments_do() -> None:
    a = hashes(seg(0, ("sys", 40), ("x", 30)), 0)
    b = hashes(seg(0, ("sys", 40), ("y", 30)), 1)
    assert len(a) == len(b) == 4
    assert a[:2] == b[:2]  # blocks 0-1 lie inside "sys"
    assert a[2] != b[2]  # block 2 holds sys[32:40] then x or y
    assert a[3] != b[3]  # and the chain keeps them apart


def test_salts_and_forms_never_share() -> None:
    plain = hashes(seg(0, ("sys", 64)))
    assert hashes(seg(0, ("sys", 64), salt="tenant-a")) != plain
    assert not set(hashes(seg(0, ("sys", 64), salt="a"))) & set(
        hashes(seg(0, ("sys", 64), salt="b"))
    )
    tokens = TraceRequest(0, 4, prompt=tuple(range(64)))
    longer = TraceRequest(0, 4, prompt=(*range(64), 7, 7, 7))
    assert hashes(tokens) == hashes(longer)[:4]
    assert not set(hashes(tokens)) & set(plain)


def test_a_segment_boundary_inside_a_block_is_part_of_its_identity() -> None:
    # Same total length, same ids, different split: different content.
    assert hashes(seg(0, ("a", 8), ("b", 24))) != hashes(seg(0, ("a", 24), ("b", 8)))


def test_memoized_chains_equal_fresh_ones() -> None:
    hasher = ContentHasher(BLOCK)
    first = seg(0, ("sys", 50), ("m0", 20), output_id="a0", output=12)
    content = hasher.content(first, 0)
    full: list[bytes] = []
    hasher.extend(content, full, (50 + 20 + 12) // BLOCK)
    hasher.remember(content, full)
    second = seg(1, ("sys", 50), ("m0", 20), ("a0", 12), ("m1", 33), output=5)
    memoized = hashes(second, 1, hasher)
    assert hasher.memo_hits == 1
    assert memoized == hashes(second, 1)  # a fresh hasher computes the same chain


def test_two_requests_sharing_a_segment_hit_in_kvoffload() -> None:
    # The engine's own prefix cache is off: a hit can only come from kvoffload.
    first = seg(0, ("sys", 64))
    shared = seg(10, ("sys", 64), ("question", 16))
    result = simulate([first, shared], prefix_caching=False)
    assert result.kvoffload_hit_tokens == 64  # both chunks of "sys"
    assert result.engine_hit_tokens == 0


def test_different_salts_do_not_hit() -> None:
    first = seg(0, ("sys", 64), salt="tenant-a")
    other = seg(10, ("sys", 64), ("question", 16), salt="tenant-b")
    same = seg(20, ("sys", 64), ("question", 16), salt="tenant-a")
    result = simulate([first, other, same], prefix_caching=False)
    assert result.kvoffload_hit_tokens == 64  # only the request with the same salt


def test_a_named_output_is_shared_with_the_next_turn() -> None:
    turn1 = seg(0, ("sys", 64), ("m0", 32), output_id="a0", output=64)
    turn2 = seg(10, ("sys", 64), ("m0", 32), ("a0", 64), ("m1", 16))
    result = simulate([turn1, turn2], prefix_caching=False)
    # 160 tokens of prompt and answer; the answer's last token has no KV (nothing
    # computed it), so the 5th chunk is incomplete: 4 chunks (128 tokens) hit, the
    # 4th of them the first half of the answer.
    assert result.kvoffload_hit_tokens == 128
    anonymous = seg(0, ("sys", 64), ("m0", 32), output=64)
    result = simulate([anonymous, turn2], prefix_caching=False)
    assert result.kvoffload_hit_tokens == 96  # sys, m0: that output was other content
