"""KV cache groups: per-group keys, what a hit needs of a window group, dead blocks."""

from __future__ import annotations

import pytest

from kvoffload.core.errors import ConfigError
from kvoffload.core.keys import ChunkKey
from kvoffload.core.kv_groups import ONE_GROUP, KVGroup, KVGroups

KEY = ChunkKey(bytes(range(16)))
HYBRID = KVGroups((KVGroup(window=64), KVGroup()))


def test_one_group_keeps_the_chain_key() -> None:
    assert ONE_GROUP.single and not ONE_GROUP.windowed
    assert ONE_GROUP.key(KEY, 0) == KEY


def test_groups_get_distinct_keys_of_the_same_size() -> None:
    keys = {HYBRID.key(KEY, g) for g in range(2)}
    assert len(keys) == 2 and KEY not in keys
    assert all(len(k) == len(KEY) for k in keys)
    assert HYBRID.key(KEY, 1) == HYBRID.key(KEY, 1)


def test_a_window_group_needs_only_its_window() -> None:
    # Window 64: the token after a 256-token hit reads tokens 193..256.
    assert HYBRID.first_needed_chunk(0, 256, 32) == 193 // 32 == 6
    assert HYBRID.first_needed_chunk(1, 256, 32) == 0
    assert HYBRID.first_needed_chunk(0, 40, 32) == 0


def test_dead_blocks_follow_the_engines_rule() -> None:
    # 100 tokens computed, window 64: tokens below 37 are skipped, block 0 freed.
    assert HYBRID.first_live_block(0, 100, 32) == 1
    assert HYBRID.first_live_block(1, 100, 32) == 0


@pytest.mark.parametrize("window", [0, -3, True])
def test_bad_windows_are_refused(window: int) -> None:
    with pytest.raises(ConfigError, match="kv_groups"):
        KVGroup(window=window)


def test_describe() -> None:
    assert HYBRID.describe() == "window=64,full"
