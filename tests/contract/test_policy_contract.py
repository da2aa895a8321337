"""One contract, every eviction policy; then each policy's own order, step by step."""

from __future__ import annotations

import pytest

from kvoffload.core.errors import ConfigError, ContractViolation
from kvoffload.core.keys import ChunkKey
from kvoffload.core.policies import EvictionPolicy, make_policy, policy_names


def K(name: str) -> ChunkKey:
    return ChunkKey(name.encode().ljust(16, b"."))


@pytest.fixture(params=policy_names())
def policy(request: pytest.FixtureRequest) -> EvictionPolicy:
    return make_policy(request.param, capacity=10)


def test_registry_lists_every_policy() -> None:
    assert policy_names() == ["arc", "lru", "s3fifo", "slru"]


def test_unknown_policy_names_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match="eviction.*valid: arc, lru, s3fifo, slru"):
        make_policy("fifo", 10)


def test_evict_returns_exactly_n_distinct_evictable_keys_and_removes_them(
    policy: EvictionPolicy,
) -> None:
    keys = [K(f"k{i}") for i in range(8)]
    for key in keys:
        policy.insert(key)
    for key in keys[::3]:
        policy.touch(key)
    pinned = {keys[0], keys[4], keys[5]}
    victims = policy.evict(3, lambda k: k not in pinned)
    assert len(victims) == 3 == len(set(victims))
    assert not set(victims) & pinned
    assert all(v not in policy for v in victims)
    assert len(policy) == 5 and set(policy) == set(keys) - set(victims)


def test_evict_never_takes_a_non_evictable_key_even_when_it_is_oldest(
    policy: EvictionPolicy,
) -> None:
    keys = [K(f"k{i}") for i in range(5)]
    for key in keys:
        policy.insert(key)
    for _ in range(4):
        victims = policy.evict(1, lambda k: k != keys[0])
        assert victims != [keys[0]]
    assert set(policy) == {keys[0]}


def test_asking_for_more_victims_than_evictable_raises(policy: EvictionPolicy) -> None:
    for i in range(3):
        policy.insert(K(f"k{i}"))
    with pytest.raises(ContractViolation):
        policy.evict(3, lambda k: k != K("k1"))


def test_remove_touch_clear(policy: EvictionPolicy) -> None:
    policy.insert(K("a"))
    policy.insert(K("b"))
    policy.remove(K("a"))
    policy.remove(K("zzz"))  # absent: no-op
    policy.touch(K("zzz"))  # absent: no-op
    assert set(policy) == {K("b")} and K("a") not in policy
    policy.clear()
    assert len(policy) == 0 and list(policy) == []


def test_lru_order() -> None:
    p = make_policy("lru", 10)
    for name in "abcd":
        p.insert(K(name))
    p.touch(K("a"))  # order now b c d a
    assert p.evict(1, lambda k: True) == [K("b")]
    p.touch(K("c"))  # d a c
    assert p.evict(2, lambda k: True) == [K("d"), K("a")]
    p.insert(K("e"))  # c e
    assert p.evict(1, lambda k: k != K("c")) == [K("e")]


def test_arc_adapts_toward_recency_after_a_ghost_hit() -> None:
    p = make_policy("arc", 10)
    for name in "abc":
        p.insert(K(name))  # T1 = a b c, p = 0
    p.touch(K("a"))  # T1 = b c, T2 = a
    assert p.evict(1, lambda k: True) == [K("b")]  # |T1| > p: oldest of T1; b -> ghost B1
    p.insert(K("b"))  # ghost hit in B1: p grows to 1, b enters T2
    # |T1| = 1 is not > p = 1: the oldest of T2 goes, even though c is older overall.
    assert p.evict(1, lambda k: True) == [K("a")]
    assert p.evict(1, lambda k: True) == [K("b")]  # still |T1| = 1 <= p: T2 first
    assert p.evict(1, lambda k: True) == [K("c")]


def test_arc_falls_back_to_the_other_list_when_the_preferred_one_is_pinned() -> None:
    p = make_policy("arc", 10)
    for name in "ab":
        p.insert(K(name))
    p.touch(K("b"))  # T1 = a, T2 = b: T1 preferred, but a is pinned
    assert p.evict(1, lambda k: k != K("a")) == [K("b")]


def test_s3fifo_demotes_one_hit_chunks_and_keeps_reused_ones() -> None:
    p = make_policy("s3fifo", 10)  # small queue target: 1
    for name in "abc":
        p.insert(K(name))  # S = a b c
    p.touch(K("a"))
    # S is over target: a was used, so it is promoted to M; b was not: evicted (ghost).
    assert p.evict(1, lambda k: True) == [K("b")]
    p.insert(K("b"))  # ghost hit: straight into M (M = a b)
    p.touch(K("b"))
    # S = c is at target: evict from M; a (count 0) goes before b (count 1).
    assert p.evict(1, lambda k: True) == [K("a")]
    # S = c is still at target, so M is preferred; b's count buys one reinsertion only.
    assert p.evict(1, lambda k: True) == [K("b")]
    assert set(p) == {K("c")}


def test_s3fifo_finds_a_victim_promoted_into_main_by_the_small_pass() -> None:
    """Found by the interleaving explorer: M holds only pinned chunks, and S's last
    evictable chunk has been used, so the S pass promotes it into M."""
    p = make_policy("s3fifo", 10)  # small target 1
    for name in ("m1", "m2"):
        p.insert(K(name))
        p.touch(K(name))
    p.insert(K("x"))
    p.evict(1, lambda k: k == K("x"))  # S -> M promotions of m1, m2; x evicted
    p.insert(K("a"))
    p.insert(K("b"))
    p.touch(K("b"))
    pinned = {K("m1"), K("m2")}
    assert sorted(p.evict(2, lambda k: k not in pinned)) == [K("a"), K("b")]
