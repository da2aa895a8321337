"""A parser of the Prometheus text exposition format (and of OpenMetrics text).

``parse_exposition(text)`` returns every sample line as a :class:`Sample` (metric
name, labels, value) and the metric names that ``# HELP`` and ``# TYPE`` comments
announce. A sample line is ``name{label="value",...} value [timestamp]``: the label
set is optional (a trailing comma is allowed), label values are double-quoted with
the escapes ``\\\\``, ``\\"`` and ``\\n``, the value is a float (``NaN``, ``+Inf`` and
``-Inf`` included), the timestamp, if any, is checked and dropped, and so is an
OpenMetrics exemplar (`` # {...} value``). Blank lines and other comments (``# EOF``
included) are skipped. Sample types are not checked against ``# TYPE``.

Contract: any other line raises :class:`ExpositionError` naming the line's number
and what is wrong with it, so that text which is not an exposition (an HTML page,
JSON, a plain message) is refused. Only ``\n`` ends a line (``\r`` before it is
dropped; a label value may hold any other character). Pure: no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}
_SHOWN = 60
"""How many characters of a refused line its error quotes."""


class ExpositionError(ValueError):
    """A line that is not a comment, a blank line or a sample; ``str`` is one line:
    ``line <n>: <what is wrong>: <the line's start>``."""

    def __init__(self, number: int, problem: str, line: str) -> None:
        shown = line if len(line) <= _SHOWN else line[:_SHOWN] + "..."
        super().__init__(f"line {number}: {problem}: {shown!r}")
        self.number = number
        self.problem = problem


@dataclass(frozen=True)
class Sample:
    """One sample line: ``labels`` are the (name, value) pairs sorted by name."""

    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, name: str) -> str | None:
        return next((v for k, v in self.labels if k == name), None)


@dataclass
class Exposition:
    """The samples in the order of the text, and the names in HELP/TYPE comments."""

    samples: list[Sample] = field(default_factory=list)
    announced: set[str] = field(default_factory=set)


class _Refused(Exception):
    """What is wrong with the line being parsed (turned into :class:`ExpositionError`)."""


def parse_exposition(text: str) -> Exposition:
    """Every sample and announced metric name of ``text`` (module docstring)."""
    out = Exposition()
    for number, raw in enumerate(text.split("\n"), start=1):  # only \n ends a line
        line = raw.strip()
        if not line:
            continue
        if line.startswith("#"):
            words = line[1:].split(None, 2)
            if len(words) >= 2 and words[0] in ("HELP", "TYPE"):
                out.announced.add(words[1])
            continue
        try:
            out.samples.append(_sample(line))
        except _Refused as exc:
            raise ExpositionError(number, str(exc), line) from None
    return out


def _sample(line: str) -> Sample:
    match = _NAME.match(line)
    if match is None:
        raise _Refused("not a metric name")
    name, i = match.group(), match.end()
    if i < len(line) and line[i] not in " \t{":
        raise _Refused("not a metric name")
    pairs: dict[str, str] = {}
    i = _skip_spaces(line, i)
    if line.startswith("{", i):
        i = _labels(line, i + 1, pairs)
    words = line[i:].split()
    if "#" in words:  # an OpenMetrics exemplar follows the value (and timestamp)
        words = words[: words.index("#")]
    if not 1 <= len(words) <= 2:
        raise _Refused("expected a value and at most a timestamp after the name")
    value = _number(words[0])
    if len(words) == 2:
        _number(words[1])
    return Sample(name, tuple(sorted(pairs.items())), value)


def _labels(line: str, i: int, pairs: dict[str, str]) -> int:
    """Parse the label set after its ``{`` (at ``i``) into ``pairs``; the index after
    its ``}``."""
    while True:
        i = _skip_spaces(line, i)
        if line.startswith("}", i):
            return i + 1
        match = _LABEL_NAME.match(line, i)
        if match is None:
            raise _Refused("not a label name")
        key, i = match.group(), _skip_spaces(line, match.end())
        if not line.startswith("=", i):
            raise _Refused(f"no '=' after label {key}")
        i = _skip_spaces(line, i + 1)
        if not line.startswith('"', i):
            raise _Refused(f"label {key}'s value is not quoted")
        value, i = _quoted(line, i + 1)
        if key in pairs:
            raise _Refused(f"label {key} twice")
        pairs[key] = value
        i = _skip_spaces(line, i)
        if line.startswith(",", i):
            i += 1
        elif not line.startswith("}", i):
            raise _Refused("expected ',' or '}' after a label")


def _quoted(line: str, i: int) -> tuple[str, int]:
    """A label value from after its opening quote: (the value unescaped, the index
    after its closing quote)."""
    chars: list[str] = []
    while i < len(line):
        c = line[i]
        if c == '"':
            return "".join(chars), i + 1
        if c == "\\":
            escaped = _ESCAPES.get(line[i + 1 : i + 2])
            if escaped is None:
                raise _Refused("bad escape in a label value")
            chars.append(escaped)
            i += 2
            continue
        chars.append(c)
        i += 1
    raise _Refused("a label value is not closed")


def _skip_spaces(line: str, i: int) -> int:
    while i < len(line) and line[i] in " \t":
        i += 1
    return i


def _number(word: str) -> float:
    if "_" in word:  # float() takes 1_000; the format does not
        raise _Refused(f"{word!r} is not a number")
    try:
        value = float(word)
    except ValueError:
        raise _Refused(f"{word!r} is not a number") from None
    return value
