"""Mooncake-style traces (``hash_ids``) read as they are: the mapping onto segments,
bad lines, mixtures, ``--head`` and ``--time-scale``, and equivalence with the
segment form they map onto."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sim_helpers import simulate

from kvoffload.core.errors import UsageError
from kvoffload.simulate.trace import TraceFile, TraceRequest, read_trace, trace_format, write_trace


def mooncake(ms: float, prompt: int, output: int, ids: list[int]) -> str:
    return json.dumps(
        {"timestamp": ms, "input_length": prompt, "output_length": output, "hash_ids": ids}
    )


def test_a_line_is_one_segment_per_hash_id(tmp_trace: Any) -> None:
    path = tmp_trace(mooncake(0, 1100, 7, [4, 5, 6]), mooncake(1500, 512, 0, [4]))
    first, second = read_trace(path)
    assert first == TraceRequest(
        0.0, 7, segments=(("4", 512), ("5", 512), ("6", 76)), where=f"{path}:1"
    )
    assert (second.t, second.output, second.segments) == (1.5, 1, (("4", 512),))
    assert trace_format(path) == "mooncake"


def test_block_tokens_is_an_option(tmp_trace: Any) -> None:
    path = tmp_trace(mooncake(0, 100, 1, [1, 2]))
    (req,) = read_trace(path, block_tokens=64)
    assert req.segments == (("1", 64), ("2", 36))
    with pytest.raises(UsageError, match=r":1: 2 hash ids of 512 tokens do not cover"):
        list(read_trace(path))


BAD = [
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": []}', "'hash_ids'"),
    ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [1]}', "'timestamp'"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]}', "input_length"),
    ('{"timestamp": 0, "input_length": 5, "output_length": -1, "hash_ids": [1]}', "output_length"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1.5]}', "hash_ids[0]"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1], "x": 0}', "'x'"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}', "do not cover"),
]


@pytest.mark.parametrize(("line", "message"), BAD)
def test_bad_lines_name_file_and_line(tmp_trace: Any, line: str, message: str) -> None:
    path = tmp_trace(mooncake(0, 10, 1, [9]), line)
    with pytest.raises(UsageError) as err:
        list(read_trace(path))
    assert str(err.value).startswith(f"{path}:2: ") and message in str(err.value)


def test_a_reused_partial_block_at_another_length_is_rejected(tmp_trace: Any) -> None:
    path = tmp_trace(mooncake(0, 10, 1, [9]), mooncake(1, 20, 1, [9]))
    with pytest.raises(UsageError, match=r":2: segment '9' has len 20 here but 10"):
        list(read_trace(path))


def test_timestamps_must_not_go_back(tmp_trace: Any) -> None:
    path = tmp_trace(mooncake(2000, 10, 1, [1]), mooncake(1000, 10, 1, [2]))
    with pytest.raises(UsageError, match=r":2: t=1.0 is earlier than t=2.0"):
        list(read_trace(path))


@pytest.mark.parametrize("native_first", [True, False])
def test_one_format_per_file(tmp_trace: Any, native_first: bool) -> None:
    native = '{"t": 0, "prompt": [1, 2], "output": 1}'
    lines = [native, mooncake(0, 10, 1, [1])]
    path = tmp_trace(*(lines if native_first else lines[::-1]))
    with pytest.raises(UsageError) as err:
        list(read_trace(path))
    kinds = ("mooncake", "kvoffload") if native_first else ("kvoffload", "mooncake")
    assert f"{path}:2: a {kinds[0]} line in a {kinds[1]} trace" in str(err.value)


def test_head_and_time_scale(tmp_trace: Any) -> None:
    path = tmp_trace(*(mooncake(1000 * i, 10, 1, [i]) for i in range(5)))
    assert [r.t for r in TraceFile(path, head=3).requests()] == [0.0, 1.0, 2.0]
    assert [r.t for r in TraceFile(path, time_scale=2.5).requests()] == [0, 2.5, 5, 7.5, 10]
    assert "first 3 requests, time x2.5" in TraceFile(path, 3, 2.5).describe()
    for bad in ({"head": 0}, {"time_scale": 0.0}, {"time_scale": float("nan")}):
        with pytest.raises(UsageError):
            TraceFile(path, **bad)


def conversation(turns: int) -> list[str]:
    """Two users whose prompts grow by two full blocks a turn (ids shared along the
    conversation and block 0 between users), half a second apart."""
    lines = []
    for turn in range(turns):
        for user in range(2):
            full = [0] + [100 * user + k for k in range(1, 2 * turn + 2)]
            tail = 1000 + 10 * user + turn  # a partial last block: never reused
            lines.append(mooncake(500 * (2 * turn + user), 32 * len(full) + 27, 8, [*full, tail]))
    return lines


def test_the_reader_equals_the_segment_form_it_maps_onto(tmp_path: Path) -> None:
    raw = tmp_path / "mooncake.jsonl"
    raw.write_text("".join(line + "\n" for line in conversation(6)))
    native = tmp_path / "native.jsonl"
    with native.open("w") as out:
        write_trace(read_trace(str(raw), block_tokens=32), out)
    assert trace_format(str(native)) == "kvoffload"
    a = simulate(read_trace(str(raw), block_tokens=32))
    b = simulate(read_trace(str(native)))
    assert a.engine_hit_tokens + a.kvoffload_hit_tokens > 0
    assert (a.prompt_tokens, a.engine_hit_tokens, a.kvoffload_hit_tokens) == (
        b.prompt_tokens,
        b.engine_hit_tokens,
        b.kvoffload_hit_tokens,
    )
