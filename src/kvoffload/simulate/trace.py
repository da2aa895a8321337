"""The JSONL trace format: one request per line, read, validated and written.

Each line is a JSON object (blank lines are skipped)::

    {"t": 12.5, "prompt": [1, 2, 3], "output": 64}
    {"t": 12.5, "segments": [{"id": "sys-1", "len": 512}, {"id": "u7-m3", "len": 80}],
     "output": 64, "output_id": "u7-a3", "salt": "tenant-a"}

- ``t``: arrival time in seconds, a finite number >= 0, non-decreasing over the file;
- exactly one of ``prompt`` (token ids, integers >= 0) or ``segments`` (named runs of
  content: every segment with the same ``id`` is the same ``len`` tokens, so requests
  whose segment lists start alike share that prefix; an id keeps one ``len`` over
  the whole file);
- ``output``: tokens to generate, an integer >= 1;
- ``output_id`` (segments form only): the generated tokens are the content of that
  segment (so a later request that includes it, e.g. the next turn of a chat, shares
  it); its ``len`` must equal ``output``. Without it the output is unique content;
- ``salt`` (optional string or null): the cache salt; requests with different salts
  never share KV.

The two forms never share content with each other. A file may instead be a
Mooncake-style trace (``hash_ids``, :mod:`kvoffload.simulate.mooncake`), read as
the segment form; a file is one format throughout. Any violation raises
:class:`~kvoffload.core.errors.UsageError` naming ``file:line`` and what is wrong.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from functools import cached_property
from itertools import islice
from typing import Any, TextIO

from kvoffload.core.errors import UsageError
from kvoffload.simulate.mooncake import (
    DEFAULT_BLOCK_TOKENS,
    MOONCAKE,
    NATIVE,
    from_mooncake,
    line_format,
)

_KEYS = ("t", "prompt", "segments", "output", "output_id", "salt")
_MAX_TOKEN = 2**63 - 1


@dataclass(frozen=True)
class TraceRequest:
    """One request of a workload; exactly one of ``prompt`` and ``segments`` is set."""

    t: float
    output: int
    prompt: tuple[int, ...] = ()
    segments: tuple[tuple[str, int], ...] = ()
    output_id: str | None = None
    salt: str | None = None
    where: str = ""  # "file:line" (or "generated #n"), for messages

    @cached_property
    def prompt_tokens(self) -> int:
        return len(self.prompt) if self.prompt else sum(n for _, n in self.segments)

    def to_json(self) -> str:
        """The request as one trace line (without the newline)."""
        obj: dict[str, Any] = {"t": round(self.t, 6)}
        if self.prompt:
            obj["prompt"] = list(self.prompt)
        else:
            obj["segments"] = [{"id": sid, "len": n} for sid, n in self.segments]
        obj["output"] = self.output
        if self.output_id is not None:
            obj["output_id"] = self.output_id
        if self.salt is not None:
            obj["salt"] = self.salt
        return json.dumps(obj, separators=(",", ":"))


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class TraceChecker:
    """Validates requests in file order: fields, non-decreasing ``t``, and one ``len``
    per segment id; the file's format is its first line's (a later line in the other
    format is an error). Owns the id table (one entry per distinct segment id).
    ``block_tokens``: tokens per hash id of a Mooncake-style file."""

    def __init__(self, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        self.last_t = 0.0
        self.last_where = ""
        self.lengths: dict[str, tuple[int, str]] = {}
        self.block_tokens = block_tokens
        self.format: str | None = None  # the file's, once its first line is read
        self.format_where = ""

    def parse(self, text: str, where: str) -> TraceRequest:
        """One line as a request; UsageError ``"{where}: ..."`` if anything is wrong."""
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise UsageError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        kind = line_format(obj)
        if self.format is None:
            self.format, self.format_where = kind, where
        elif kind != self.format:
            raise UsageError(
                f"{where}: a {kind} line in a {self.format} trace (format set by "
                f"{self.format_where}; one format per file)"
            )
        if kind == MOONCAKE:
            t, output, segments = from_mooncake(obj, where, self.block_tokens)
            return self.check(TraceRequest(t, output, segments=segments, where=where))
        unknown = sorted(set(obj) - set(_KEYS))
        if unknown:
            raise UsageError(f"{where}: unknown key {unknown[0]!r} (keys: {', '.join(_KEYS)})")
        return self.check(_from_obj(obj, where))

    def check(self, req: TraceRequest) -> TraceRequest:
        """Check ``req`` against the requests before it (time order, segment lengths)."""
        where = req.where
        if req.t < self.last_t:
            raise UsageError(
                f"{where}: t={req.t} is earlier than t={self.last_t} at {self.last_where} "
                "(timestamps must be non-decreasing: sort the trace by t)"
            )
        self.last_t, self.last_where = req.t, where
        named = list(req.segments)
        if req.output_id is not None:
            named.append((req.output_id, req.output))
        for sid, n in named:
            seen = self.lengths.setdefault(sid, (n, where))
            if seen[0] != n:
                raise UsageError(
                    f"{where}: segment {sid!r} has len {n} here but {seen[0]} at {seen[1]} "
                    "(a segment id names the same content everywhere)"
                )
        return req


def _from_obj(obj: dict[str, Any], where: str) -> TraceRequest:
    t = obj.get("t")
    if not isinstance(t, int | float) or isinstance(t, bool) or not math.isfinite(t) or t < 0:
        raise UsageError(f"{where}: 't' must be a number of seconds >= 0, got {t!r}")
    output = obj.get("output")
    if not isinstance(output, int) or isinstance(output, bool) or output < 1:
        raise UsageError(f"{where}: 'output' must be an integer >= 1 (tokens), got {output!r}")
    salt = obj.get("salt")
    if salt is not None and not isinstance(salt, str):
        raise UsageError(f"{where}: 'salt' must be a string, got {salt!r}")
    if ("prompt" in obj) == ("segments" in obj):
        raise UsageError(f"{where}: give exactly one of 'prompt' (token ids) or 'segments'")
    output_id = obj.get("output_id")
    if "prompt" in obj:
        prompt = obj["prompt"]
        if not isinstance(prompt, list) or not prompt:
            raise UsageError(f"{where}: 'prompt' must be a non-empty list of token ids")
        for i, token in enumerate(prompt):
            if not _is_int(token) or not 0 <= token <= _MAX_TOKEN:
                raise UsageError(
                    f"{where}: prompt[{i}] must be a token id (integer >= 0), got {token!r}"
                )
        if output_id is not None:
            raise UsageError(f"{where}: 'output_id' needs the 'segments' form")
        return TraceRequest(float(t), output, prompt=tuple(prompt), salt=salt, where=where)
    segments = obj["segments"]
    if not isinstance(segments, list) or not segments:
        raise UsageError(f"{where}: 'segments' must be a non-empty list of {{id, len}} objects")
    parsed = []
    for i, seg in enumerate(segments):
        if not isinstance(seg, dict) or set(seg) != {"id", "len"}:
            raise UsageError(f"{where}: segments[{i}] must be an object with keys 'id' and 'len'")
        sid, n = seg["id"], seg["len"]
        if not isinstance(sid, str) or not sid:
            raise UsageError(f"{where}: segments[{i}].id must be a non-empty string, got {sid!r}")
        if not _is_int(n) or n < 1:
            raise UsageError(f"{where}: segments[{i}].len must be an integer >= 1, got {n!r}")
        parsed.append((sid, n))
    if output_id is not None and (not isinstance(output_id, str) or not output_id):
        raise UsageError(f"{where}: 'output_id' must be a non-empty string, got {output_id!r}")
    return TraceRequest(
        float(t), output, segments=tuple(parsed), output_id=output_id, salt=salt, where=where
    )


def read_trace(path: str, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> Iterator[TraceRequest]:
    """Stream and validate the requests of the trace file at ``path``, in order
    (``block_tokens``: tokens per hash id if it is a Mooncake-style file).

    Raises UsageError for an unreadable file or the first bad line (``path:line``)."""
    checker = TraceChecker(block_tokens)
    try:
        handle = open(path, encoding="utf-8")  # noqa: SIM115 (closed below; generator)
    except OSError as exc:
        raise UsageError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    with handle:
        try:
            for number, line in enumerate(handle, 1):
                if line.strip():
                    yield checker.parse(line, f"{path}:{number}")
        except UnicodeDecodeError:
            raise UsageError(f"{path}: not a UTF-8 text file") from None


def write_trace(requests: Iterable[TraceRequest], out: TextIO) -> int:
    """Write ``requests`` as trace lines to ``out``; return how many."""
    count = 0
    for req in requests:
        out.write(req.to_json())
        out.write("\n")
        count += 1
    return count


@dataclass(frozen=True)
class TraceSummary:
    """What a full pass over a workload found (the trace was valid)."""

    requests: int
    prompt_tokens: int
    output_tokens: int
    unique_tokens: int  # distinct content (an upper bound for the token form)
    duration_s: float  # timestamp of the last request
    max_request_tokens: int  # the largest prompt + output (or an upper bound)


def summarize(requests: Iterable[TraceRequest]) -> TraceSummary:
    """Consume ``requests`` (validating a file as a side effect) and summarize them."""
    count = prompt = output = unique = largest = 0
    last = 0.0
    seen: set[tuple[str | None, str]] = set()
    for req in requests:
        count += 1
        n = req.prompt_tokens
        prompt += n
        output += req.output
        largest = max(largest, n + req.output)
        last = req.t
        if req.prompt:
            unique += n + req.output
            continue
        for sid, length in req.segments:
            if (req.salt, sid) not in seen:
                seen.add((req.salt, sid))
                unique += length
        if req.output_id is None:
            unique += req.output
        elif (req.salt, req.output_id) not in seen:
            seen.add((req.salt, req.output_id))
            unique += req.output
    return TraceSummary(count, prompt, output, unique, last, largest)


def trace_format(path: str) -> str:
    """The format of the trace file at ``path``, its first non-blank line's
    (``"mooncake"`` or ``"kvoffload"``); an unreadable file or line is left to
    :func:`read_trace` to report (``"kvoffload"`` here)."""
    try:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                if line.strip():
                    obj = json.loads(line)
                    return line_format(obj) if isinstance(obj, dict) else NATIVE
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        pass
    return NATIVE


@dataclass(frozen=True)
class TraceFile:
    """A workload read from a trace file (picklable: sweep workers re-read it).

    ``head``: only the first that many requests (None: all); ``time_scale``: every
    arrival time multiplied by it (2: half the rate); ``block_tokens``: tokens per
    hash id of a Mooncake-style file."""

    path: str
    head: int | None = None
    time_scale: float = 1.0
    block_tokens: int = DEFAULT_BLOCK_TOKENS

    def __post_init__(self) -> None:
        if self.head is not None and self.head < 1:
            raise UsageError("--head: must be an integer >= 1")
        if not (math.isfinite(self.time_scale) and self.time_scale > 0):
            raise UsageError("--time-scale: must be a number > 0")
        if self.block_tokens < 1:
            raise UsageError("--trace-block-tokens: must be an integer >= 1")

    def requests(self) -> Iterator[TraceRequest]:
        found: Iterator[TraceRequest] = read_trace(self.path, self.block_tokens)
        if self.head is not None:
            found = islice(found, self.head)
        if self.time_scale == 1.0:
            return found
        scale = self.time_scale
        return (replace(req, t=req.t * scale) for req in found)

    @property
    def format(self) -> str:
        """``"mooncake"`` or ``"kvoffload"`` (the first line's; validated on reading)."""
        return trace_format(self.path)

    def summary(self, fits: int) -> TraceSummary:
        """A full validating pass over the file (``fits`` is not needed here)."""
        return summarize(self.requests())

    def describe(self) -> str:
        extra = [f"first {self.head} requests"] if self.head is not None else []
        if self.time_scale != 1.0:
            extra.append(f"time x{self.time_scale:g}")
        return f"trace {self.path}" + (f" ({', '.join(extra)})" if extra else "")
