"""SLRU's own order: LRU outside a protected share, promotion on reuse (a touch, or a
store of a ghost), demotion in last-use order, bounded ghosts, pins respected; and
that it is the default host policy."""

from __future__ import annotations

import pytest

from kvoffload.core.config.typed import OffloadConfig
from kvoffload.core.errors import ContractViolation
from kvoffload.core.keys import ChunkKey
from kvoffload.core.policies import SLRUPolicy, make_policy


def K(name: str) -> ChunkKey:
    return ChunkKey(name.encode().ljust(16, b"."))


def everything(key: ChunkKey) -> bool:
    return True


def test_a_reused_chunk_outlives_newer_one_off_chunks() -> None:
    p = make_policy("slru", 8)  # protected holds 2
    p.insert(K("a"))
    p.touch(K("a"))  # reused: protected
    for name in "bcd":
        p.insert(K(name))
    # LRU would take a first (oldest); SLRU takes the never-reused ones first.
    assert p.evict(3, everything) == [K("b"), K("c"), K("d")]
    assert p.evict(1, everything) == [K("a")]


def test_probation_is_least_recently_used_first() -> None:
    p = make_policy("slru", 8)
    for name in "abc":
        p.insert(K(name))
    assert p.evict(3, everything) == [K("a"), K("b"), K("c")]


def test_protected_overflow_is_demoted_and_evicted_in_its_last_use_order() -> None:
    p = SLRUPolicy(4, protected_fraction=0.25)
    assert p.protected_limit == 1
    p.insert(K("a"))
    p.touch(K("a"))  # protected
    p.insert(K("c"))  # used after a
    p.insert(K("b"))
    p.touch(K("b"))  # protected overflows: a is demoted
    assert list(p.demoted) == [K("a")] and list(p.protected) == [K("b")]
    # a was last used before c: it goes first, then c, then the protected b.
    assert p.evict(3, everything) == [K("a"), K("c"), K("b")]


def test_touching_a_demoted_chunk_protects_it_again() -> None:
    p = SLRUPolicy(4, protected_fraction=0.25)
    for name in "ab":
        p.insert(K(name))
        p.touch(K(name))  # a ends demoted, b protected
    p.insert(K("c"))
    p.touch(K("a"))  # protected again; b is demoted
    assert list(p.protected) == [K("a")] and list(p.demoted) == [K("b")]
    assert p.evict(3, everything) == [K("b"), K("c"), K("a")]


def test_touching_a_protected_chunk_refreshes_it_there() -> None:
    p = SLRUPolicy(8)
    for name in "ab":
        p.insert(K(name))
        p.touch(K(name))
    p.touch(K("a"))  # protected order: b a
    assert p.evict(2, everything) == [K("b"), K("a")]


def test_pinned_chunks_are_skipped_in_both_segments() -> None:
    p = SLRUPolicy(8)
    for name in "abcd":
        p.insert(K(name))
    p.touch(K("c"))
    p.touch(K("d"))  # probation a b, protected c d
    pinned = {K("a"), K("c")}
    assert p.evict(2, lambda k: k not in pinned) == [K("b"), K("d")]
    assert set(p) == pinned
    with pytest.raises(ContractViolation):
        p.evict(1, lambda k: k not in pinned)
    assert set(p) == pinned  # nothing removed by the failed call


def test_no_protected_segment_is_plain_lru_over_inserts_and_touches() -> None:
    slru, lru = SLRUPolicy(4, protected_fraction=0.0), make_policy("lru", 4)
    for policy in (slru, lru):
        for name in "abcd":
            policy.insert(K(name))
        policy.touch(K("b"))
        policy.touch(K("a"))
    assert slru.evict(4, everything) == lru.evict(4, everything)


def test_a_chunk_stored_again_after_its_eviction_enters_protected() -> None:
    p = SLRUPolicy(8)
    for name in "ab":
        p.insert(K(name))
    assert p.evict(1, everything) == [K("a")]  # a becomes a ghost
    p.insert(K("a"))  # wanted again: a reuse
    p.insert(K("c"))
    assert list(p.protected) == [K("a")]
    assert p.evict(3, everything) == [K("b"), K("c"), K("a")]


def test_ghosts_are_bounded_by_capacity_oldest_forgotten_first() -> None:
    p = SLRUPolicy(2)
    names = "abcd"
    for name in names:
        p.insert(K(name))
        p.evict(1, everything)
    assert list(p.ghost) == [K("c"), K("d")]
    p.insert(K("a"))  # forgotten: a new chunk again
    assert list(p.probation) == [K("a")] and not p.protected


def test_removed_chunks_are_not_ghosts_and_clear_forgets_ghosts() -> None:
    p = SLRUPolicy(8)
    for name in "ab":
        p.insert(K(name))
    p.remove(K("a"))  # a failed store or a discard: not a reuse signal
    p.evict(1, everything)  # b becomes a ghost
    assert list(p.ghost) == [K("b")]
    p.insert(K("a"))
    assert list(p.probation) == [K("a")]
    p.clear()
    p.insert(K("b"))
    assert list(p.probation) == [K("b")] and not p.protected


def test_a_bad_protected_fraction_is_refused() -> None:
    with pytest.raises(ContractViolation, match="protected_fraction"):
        SLRUPolicy(8, protected_fraction=1.5)


def test_the_merge_of_probation_and_demoted_skips_pinned_chunks() -> None:
    p = SLRUPolicy(4, protected_fraction=0.25)
    for name in "ab":
        p.insert(K(name))
        p.touch(K(name))  # a demoted (last used 2nd), b protected
    p.insert(K("c"))
    p.insert(K("d"))
    assert p.evict(2, lambda k: k not in {K("a"), K("c")}) == [K("d"), K("b")]
    assert set(p) == {K("a"), K("c")}


def test_slru_is_opt_in_and_lru_stays_the_default() -> None:
    assert OffloadConfig(cpu_bytes=1 << 30).eviction == "lru"  # decision 0014
    assert OffloadConfig(cpu_bytes=1 << 30, eviction="slru").eviction == "slru"
