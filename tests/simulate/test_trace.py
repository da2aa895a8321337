"""The JSONL trace format: valid lines, every kind of invalid line, round trips."""

from __future__ import annotations

import io
import json
from typing import Any

import pytest

from kvoffload.core.errors import UsageError
from kvoffload.simulate.trace import TraceRequest, read_trace, summarize, write_trace

GOOD = '{"t": 0, "prompt": [1, 2, 3], "output": 4}'


def test_both_forms_parse(tmp_trace: Any) -> None:
    path = tmp_trace(
        GOOD,
        "",
        '{"t": 1.5, "segments": [{"id": "sys", "len": 512}, {"id": "u1", "len": 80}], '
        '"output": 64, "output_id": "a1", "salt": "tenant-a"}',
        '{"t": 1.5, "segments": [{"id": "sys", "len": 512}], "output": 1, "salt": null}',
    )
    first, second, third = read_trace(path)
    assert first == TraceRequest(0.0, 4, prompt=(1, 2, 3), where=f"{path}:1")
    assert second.segments == (("sys", 512), ("u1", 80))
    assert (second.output_id, second.salt, second.prompt_tokens) == ("a1", "tenant-a", 592)
    assert second.where == f"{path}:3"  # blank line 2 skipped, lines still counted
    assert third.salt is None and third.prompt_tokens == 512


BAD_LINES = [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ('{"t": 0, "prompt": [1], "output": 1, "extra": 1}', "unknown key 'extra'"),
    ('{"prompt": [1], "output": 1}', "'t' must be a number"),
    ('{"t": -1, "prompt": [1], "output": 1}', "'t' must be a number"),
    ('{"t": Infinity, "prompt": [1], "output": 1}', "'t' must be a number"),
    ('{"t": "0", "prompt": [1], "output": 1}', "'t' must be a number"),
    ('{"t": 0, "output": 1}', "exactly one of"),
    ('{"t": 0, "prompt": [1], "segments": [{"id": "a", "len": 1}], "output": 1}', "exactly one"),
    ('{"t": 0, "prompt": [], "output": 1}', "non-empty list of token ids"),
    ('{"t": 0, "prompt": [1, -2], "output": 1}', "prompt[1] must be a token id"),
    ('{"t": 0, "prompt": [1.5], "output": 1}', "prompt[0] must be a token id"),
    ('{"t": 0, "prompt": [true], "output": 1}', "prompt[0] must be a token id"),
    ('{"t": 0, "prompt": [1]}', "'output' must be an integer >= 1"),
    ('{"t": 0, "prompt": [1], "output": 0}', "'output' must be an integer >= 1"),
    ('{"t": 0, "prompt": [1], "output": 2.5}', "'output' must be an integer >= 1"),
    ('{"t": 0, "prompt": [1], "output": 1, "salt": 7}', "'salt' must be a string"),
    ('{"t": 0, "prompt": [1], "output": 1, "output_id": "a"}', "needs the 'segments' form"),
    ('{"t": 0, "segments": [], "output": 1}', "'segments' must be a non-empty list"),
    ('{"t": 0, "segments": [{"id": "a"}], "output": 1}', "segments[0] must be an object"),
    ('{"t": 0, "segments": [{"id": "", "len": 1}], "output": 1}', "segments[0].id must be"),
    ('{"t": 0, "segments": [{"id": "a", "len": 0}], "output": 1}', "segments[0].len must be"),
    (
        '{"t": 0, "segments": [{"id": "a", "len": 1}], "output": 1, "output_id": ""}',
        "'output_id' must be a non-empty string",
    ),
]


@pytest.mark.parametrize(("line", "message"), BAD_LINES)
def test_each_bad_line_is_one_usage_error_naming_file_and_line(
    tmp_trace: Any, line: str, message: str
) -> None:
    path = tmp_trace(GOOD, line)
    with pytest.raises(UsageError) as caught:
        list(read_trace(path))
    text = str(caught.value)
    assert text.startswith(f"{path}:2: ")
    assert message in text
    assert "\n" not in text


def test_timestamps_must_not_decrease(tmp_trace: Any) -> None:
    path = tmp_trace(
        '{"t": 5, "prompt": [1], "output": 1}',
        '{"t": 5, "prompt": [1], "output": 1}',
        '{"t": 4.5, "prompt": [1], "output": 1}',
    )
    with pytest.raises(UsageError) as caught:
        list(read_trace(path))
    assert str(caught.value).startswith(f"{path}:3: t=4.5 is earlier than t=5.0 at {path}:2 ")


def test_a_segment_id_keeps_one_length(tmp_trace: Any) -> None:
    path = tmp_trace(
        '{"t": 0, "segments": [{"id": "sys", "len": 512}], "output": 1}',
        '{"t": 1, "segments": [{"id": "sys", "len": 80}], "output": 1}',
    )
    with pytest.raises(UsageError) as caught:
        list(read_trace(path))
    assert str(caught.value).startswith(f"{path}:2: segment 'sys' has len 80 here but 512 at ")


def test_output_id_length_must_equal_output(tmp_trace: Any) -> None:
    path = tmp_trace(
        '{"t": 0, "segments": [{"id": "q", "len": 8}], "output": 4, "output_id": "a"}',
        '{"t": 1, "segments": [{"id": "q", "len": 8}, {"id": "a", "len": 5}], "output": 1}',
    )
    with pytest.raises(UsageError) as caught:
        list(read_trace(path))
    assert str(caught.value).startswith(f"{path}:2: segment 'a' has len 5 here but 4 at ")


def test_unreadable_and_binary_files(tmp_path: Any) -> None:
    with pytest.raises(UsageError, match="cannot read trace"):
        list(read_trace(str(tmp_path / "missing.jsonl")))
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage\n")
    with pytest.raises(UsageError, match="not a UTF-8 text file"):
        list(read_trace(str(binary)))


def test_write_then_read_round_trips(tmp_path: Any) -> None:
    requests = [
        TraceRequest(0.0, 3, prompt=(5, 6, 7)),
        TraceRequest(0.25, 8, segments=(("sys", 64), ("m", 9)), output_id="a", salt="s"),
    ]
    out = io.StringIO()
    assert write_trace(requests, out) == 2
    lines = out.getvalue().splitlines()
    assert json.loads(lines[0]) == {"t": 0.0, "prompt": [5, 6, 7], "output": 3}
    path = tmp_path / "round.jsonl"
    path.write_text(out.getvalue())
    back = list(read_trace(str(path)))
    assert [(r.t, r.output, r.prompt, r.segments, r.output_id, r.salt) for r in back] == [
        (r.t, r.output, r.prompt, r.segments, r.output_id, r.salt) for r in requests
    ]


def test_summary_counts_distinct_content_once() -> None:
    requests = [
        TraceRequest(0, 4, segments=(("sys", 100), ("a", 10)), output_id="b"),
        TraceRequest(1, 4, segments=(("sys", 100), ("a", 10), ("b", 4), ("c", 6))),
        TraceRequest(2, 4, segments=(("sys", 100),), salt="other"),
        TraceRequest(3, 2, prompt=(1, 2, 3)),
    ]
    s = summarize(requests)
    assert (s.requests, s.prompt_tokens, s.output_tokens) == (4, 333, 14)
    # sys, a, b, c; the anonymous output of request 2; sys again under another salt and
    # its output; the token-form request's prompt and output.
    assert s.unique_tokens == 100 + 10 + 4 + 6 + 4 + 100 + 4 + 5
    assert (s.duration_s, s.max_request_tokens) == (3, 124)
