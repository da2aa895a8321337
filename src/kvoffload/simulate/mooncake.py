"""Mooncake-style trace lines (``hash_ids``) as simulator requests, and which format
a trace line is in.

Mooncake's released traces (FAST'25) have one JSON object a line::

    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2]}

- ``timestamp``: arrival in milliseconds from the trace's start (non-decreasing);
- ``input_length``: prompt tokens; ``output_length``: generated tokens;
- ``hash_ids``: one id per block of ``block_tokens`` prompt tokens (512 in Mooncake's
  traces), in order; equal ids at equal positions are equal content, so two requests
  share exactly the prefix where their id lists agree. The last block may be partial:
  ``block_tokens * (len(hash_ids) - 1) < input_length <= block_tokens * len(hash_ids)``.

A line maps onto the segment form (:mod:`kvoffload.simulate.trace`): one segment per
hash id, ``id = str(hash_id)``, ``len = block_tokens`` except the last, which is the
rest of the prompt; the output is unique content; ``t = timestamp / 1000``. An
``output_length`` of 0 is read as 1 (the engine generates at least one token). The
segment form's rule that an id keeps one length then checks that a partial last
block is never reused at another length.

:func:`line_format` decides a line's format from its keys; a file is one format
(:class:`~kvoffload.simulate.trace.TraceChecker` rejects a mixture).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from kvoffload.core.errors import UsageError

MOONCAKE = "mooncake"
NATIVE = "kvoffload"
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length", "hash_ids")
DEFAULT_BLOCK_TOKENS = 512


class MooncakeLine(NamedTuple):
    """One line read: arrival (seconds), output tokens, ``(id, len)`` segments."""

    t: float
    output: int
    segments: tuple[tuple[str, int], ...]


def line_format(obj: dict[str, Any]) -> str:
    """``MOONCAKE`` when the line has ``hash_ids``, else ``NATIVE``."""
    return MOONCAKE if "hash_ids" in obj else NATIVE


def _int(obj: dict[str, Any], key: str, where: str, low: int) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise UsageError(f"{where}: '{key}' must be an integer >= {low}, got {value!r}")
    return value


def from_mooncake(obj: dict[str, Any], where: str, block_tokens: int) -> MooncakeLine:
    """The request of one Mooncake line (see the module docstring); UsageError
    ``"{where}: ..."`` for a bad line."""
    unknown = sorted(set(obj) - set(MOONCAKE_KEYS))
    if unknown:
        raise UsageError(
            f"{where}: unknown key {unknown[0]!r} in a Mooncake line "
            f"(keys: {', '.join(MOONCAKE_KEYS)})"
        )
    stamp = obj.get("timestamp")
    if (
        not isinstance(stamp, int | float)
        or isinstance(stamp, bool)
        or not math.isfinite(stamp)
        or stamp < 0
    ):
        raise UsageError(f"{where}: 'timestamp' must be milliseconds >= 0, got {stamp!r}")
    prompt = _int(obj, "input_length", where, 1)
    output = _int(obj, "output_length", where, 0)
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not ids:
        raise UsageError(f"{where}: 'hash_ids' must be a non-empty list of block ids")
    for i, h in enumerate(ids):
        if not isinstance(h, int | str) or isinstance(h, bool):
            raise UsageError(f"{where}: hash_ids[{i}] must be an integer or a string, got {h!r}")
    n = len(ids)
    if not block_tokens * (n - 1) < prompt <= block_tokens * n:
        raise UsageError(
            f"{where}: {n} hash ids of {block_tokens} tokens do not cover input_length "
            f"{prompt} (expected {block_tokens * (n - 1) + 1}..{block_tokens * n} tokens; "
            "see --trace-block-tokens)"
        )
    segments = [(str(h), block_tokens) for h in ids]
    segments[-1] = (segments[-1][0], prompt - block_tokens * (n - 1))
    return MooncakeLine(stamp / 1000.0, max(1, output), tuple(segments))
