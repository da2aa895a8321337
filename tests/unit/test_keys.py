"""Chunk keys: determinism, chaining, namespace and salt separation, two entry points."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.core.errors import ConfigError
from kvoffload.core.keys import (
    KEY_BYTES,
    KeyChain,
    Namespace,
    block_hashes,
    keys_from_block_hashes,
    keys_from_tokens,
    shard_key,
)

NS = Namespace(model="tiny-llama", layout="abc123", dtype="float32")
TOKENS = list(range(1000, 1000 + 32 * 8))


def test_keys_are_128_bit_and_one_per_full_chunk() -> None:
    keys = keys_from_tokens(NS, TOKENS + [7] * 31, chunk_tokens=64, block_size=32)
    assert len(keys) == 4  # 8 full blocks = 4 chunks; the partial tail gets no key
    assert all(isinstance(k, bytes) and len(k) == KEY_BYTES for k in keys)
    assert len(set(keys)) == 4


def test_keys_are_deterministic_across_processes() -> None:
    here = [k.hex() for k in keys_from_tokens(NS, TOKENS, 64, 32, salt="tenant-a")]
    code = (
        "from kvoffload.core.keys import Namespace, keys_from_tokens\n"
        "ns = Namespace(model='tiny-llama', layout='abc123', dtype='float32')\n"
        f"keys = keys_from_tokens(ns, {TOKENS!r}, 64, 32, salt='tenant-a')\n"
        "print(' '.join(k.hex() for k in keys))\n"
    )
    env = {"PYTHONHASHSEED": "12345", "PATH": ""}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.split() == here


def test_key_format_is_stable() -> None:
    """Keys name chunks in disk slabs and Redis: the same inputs must give the same
    bytes in every kvoffload version (a change needs a new format tag)."""
    keys = keys_from_tokens(NS, TOKENS, 64, 32, salt="tenant-a")
    assert keys[0].hex() == "c2ac696a859a355f533a270954b4cc96"
    assert keys[-1].hex() == "cd44085019e9372a154ac01cd04191a9"


def test_a_key_names_its_whole_prefix() -> None:
    base = keys_from_tokens(NS, TOKENS, 32, 32)
    changed_head = keys_from_tokens(NS, [0] + TOKENS[1:], 32, 32)
    changed_tail = keys_from_tokens(NS, TOKENS[:-1] + [0], 32, 32)
    assert not set(base) & set(changed_head)  # every later key depends on chunk 0
    assert base[:-1] == changed_tail[:-1] and base[-1] != changed_tail[-1]
    assert keys_from_tokens(NS, TOKENS[:96], 32, 32) == base[:3]  # prefix-stable


@pytest.mark.parametrize(
    "other",
    [
        Namespace(model="other-model", layout="abc123", dtype="float32"),
        Namespace(model="tiny-llama", layout="abc124", dtype="float32"),
        Namespace(model="tiny-llama", layout="abc123", dtype="bfloat16"),
        Namespace(model="tiny-llama", layout="abc123", dtype="float32", parallel="tp2"),
    ],
)
def test_namespaces_never_share_keys(other: Namespace) -> None:
    assert not set(keys_from_tokens(NS, TOKENS, 32, 32)) & set(
        keys_from_tokens(other, TOKENS, 32, 32)
    )


@pytest.mark.parametrize("salt_a, salt_b", [(None, "a"), ("a", "b"), ("a", b"a\x00"), ("", None)])
def test_salts_never_share_keys(salt_a: str | None, salt_b: str | bytes | None) -> None:
    a = keys_from_tokens(NS, TOKENS, 32, 32, salt=salt_a)
    b = keys_from_tokens(NS, TOKENS, 32, 32, salt=salt_b)
    assert not set(a) & set(b)


def test_token_and_block_hash_entry_points_agree() -> None:
    for blocks_per_chunk in (1, 2, 4):
        hashes = block_hashes(TOKENS, 32, salt="s")
        assert keys_from_block_hashes(NS, hashes, blocks_per_chunk) == keys_from_tokens(
            NS, TOKENS, 32 * blocks_per_chunk, 32, salt="s"
        )


def test_block_hash_chains_continue_from_a_parent() -> None:
    whole = block_hashes(TOKENS, 32, salt="s")
    head = block_hashes(TOKENS[:96], 32, salt="s")
    tail = block_hashes(TOKENS[96:], 32, parent=head[-1])
    assert head + tail == whole


@given(
    tokens=st.lists(st.integers(0, 2**31), max_size=200),
    blocks_per_chunk=st.integers(1, 3),
    cuts=st.lists(st.integers(0, 200), max_size=5),
)
def test_incremental_key_chain_equals_batch(
    tokens: list[int], blocks_per_chunk: int, cuts: list[int]
) -> None:
    hashes = block_hashes(tokens, 8)
    chain = KeyChain(NS, blocks_per_chunk)
    for cut in sorted(cuts):
        chain.extend(hashes[: cut // 8])
    assert chain.extend(hashes) == keys_from_block_hashes(NS, hashes, blocks_per_chunk)


def test_shard_keys_differ_per_rank_and_from_the_chunk_key() -> None:
    key = keys_from_tokens(NS, TOKENS, 32, 32)[0]
    shards = {shard_key(key, r) for r in range(4)}
    assert len(shards) == 4 and key not in shards


def test_bad_parameters_name_the_field() -> None:
    with pytest.raises(ConfigError, match="chunk_tokens"):
        keys_from_tokens(NS, TOKENS, 48, 32)
    with pytest.raises(ConfigError, match="namespace.model"):
        Namespace(model="", layout="x", dtype="y")
    with pytest.raises(ConfigError, match="blocks_per_chunk"):
        KeyChain(NS, 0)
